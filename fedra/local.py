"""Start a coordinator and sites as real processes on localhost, through the CLI.

Used by ``fedra demo``, the multi-process tests and the benchmarks: one place that
knows how to launch, wait for readiness (never sleep-and-hope), and clean up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedra import pki
from fedra.admin import AdminClient
from fedra.config import READY_FILE
from fedra.lifetime import Lifeline


class ClusterError(RuntimeError):
    """A process did not come up, or died, while the cluster waited on it."""


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait(timeout_s)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def write_site_config(
    path: Path,
    site: Mapping[str, Any],
    data: Mapping[str, Any],
    parallel: Mapping[str, Any] | None = None,
    tables: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Write a site.toml: top-level keys ``site``, a ``[data]`` and a ``[parallel]`` table,
    and any other ``tables`` (e.g. ``{"metrics": {"http": "127.0.0.1:0"}}``)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in site.items()]
    every = {"data": data, "parallel": parallel or {}, **(tables or {})}
    for name, table in every.items():
        if table or name == "data":
            lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class LocalCluster:
    """A state directory with a coordinator and any number of sites under it."""

    state_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    # mTLS like production: a throw-away CA in state_dir/pki, a folder per participant.
    secure: bool = True
    coordinator: ManagedProcess | None = None
    sites: dict[str, ManagedProcess] = field(default_factory=dict)
    address: str = ""
    admin_address: str = ""  # the admin port, where the daemon has one (replica.py)
    # Every process started here follows it: they stop when this process ends, however it
    # ends (fedra.lifetime), not only when ``stop`` runs.
    _lifeline: Lifeline | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "logs").mkdir(exist_ok=True)

    def _spawn(
        self, name: str, args: list[str], extra_env: Mapping[str, str] | None
    ) -> ManagedProcess:
        log_path = self.state_dir / "logs" / f"{name}.log"
        if self._lifeline is None:
            self._lifeline = Lifeline()
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env, **(extra_env or {})}
        env.update(self._lifeline.env())
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "fedra", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                pass_fds=(self._lifeline.fd,),
                start_new_session=True,  # a Ctrl-C in the terminal reaches us, not them
            )
        return ManagedProcess(name, popen, log_path)

    def start_coordinator(
        self,
        port: int = 0,
        db_url: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
        flags: Sequence[str] = (),
    ) -> str:
        """Start the daemon and wait for its readiness file; returns its address."""
        ready = self.state_dir / READY_FILE
        ready.unlink(missing_ok=True)
        args = ["coordinator", "--state-dir", str(self.state_dir), "--port", str(port), *flags]
        args += (
            ["--tls-dir", str(self._pki_folder("coordinator", ""))]
            if self.secure
            else ["--insecure"]
        )
        if db_url:
            args += ["--db", db_url]
        proc = self._spawn("coordinator", args, extra_env)
        self.coordinator = proc
        info = self.wait_for(
            lambda: _read_ready(ready, proc.pid), proc, timeout_s, "write coordinator.json"
        )
        self.address = str(info["address"])
        self.admin_address = str(info.get("admin_address", ""))
        return self.address

    def start_site(
        self,
        site_id: str,
        tasks: list[str],
        data: Mapping[str, Any],
        extra_env: Mapping[str, str] | None = None,
        threads: int = 1,
        reconnect_max_s: float = 2.0,
        parallel: Mapping[str, Any] | None = None,
        coordinator: str | None = None,
        tables: Mapping[str, Mapping[str, Any]] | None = None,
        node_rank: int = 0,
    ) -> ManagedProcess:
        """Write ``<site_id>.toml`` (with optional ``[parallel]`` and other ``tables``) and
        start it. ``node_rank`` > 0: another node of a site on several nodes (``parallel``
        names ``nnodes`` and ``rdzv_endpoint``), kept in ``sites`` as
        ``<site_id>.node<N>`` with a state directory of its own."""
        name = site_id if node_rank == 0 else f"{site_id}.node{node_rank}"
        if node_rank:
            parallel = {**(parallel or {}), "node_rank": node_rank}
        site = {
            "site_id": site_id,
            "coordinator": coordinator or self.address,  # e.g. a WAN-emulating proxy
            "allowed_tasks": tasks,
            "threads": threads,
            "reconnect_max_s": reconnect_max_s,
            "state_dir": str(self.state_dir / "sites" / name),
        }
        if self.secure:
            site["tls_dir"] = str(self._pki_folder("site", site_id))
        else:
            site["insecure"] = True
        path = self.state_dir / f"{name}.toml"
        config = write_site_config(path, site, data, parallel, tables)
        proc = self._spawn(name, ["site", "--config", str(config)], extra_env)
        self.sites[name] = proc
        return proc

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    def _pki_folder(self, role: str, name: str) -> Path:
        """The participant's certificate folder, provisioning the CA or the participant first."""
        if not (self.pki_dir / "ca").exists():
            pki.provision(
                self.pki_dir,
                coordinator_hosts=["localhost", "127.0.0.1"],
                sites=[],
                admins=["admin"],
            )
        folder = (
            self.pki_dir / "coordinator"
            if role == "coordinator"
            else self.pki_dir / f"{role}s" / name
        )
        if not folder.exists():
            pki.add_participant(self.pki_dir, role, name)
        return folder

    def site_tls_folder(self, site_id: str) -> Path:
        """A site's certificate folder from this cluster's CA (provisioned on first use):
        e.g. for a region, a site of this coordinator that is a coordinator itself."""
        return self._pki_folder("site", site_id)

    def admin(self, admin_port: bool = False) -> AdminClient:
        """An admin client of the site port's admin service, or with ``admin_port`` of the
        operators' read process."""
        tls = pki.load_folder(self._pki_folder("admin", "admin")) if self.secure else None
        if admin_port and not self.admin_address:
            raise ClusterError("the coordinator serves no admin port (--admin-port none?)")
        return AdminClient(self.admin_address if admin_port else self.address, tls=tls)

    def wait_for_sites(self, site_ids: list[str], timeout_s: float = 60.0) -> None:
        """Wait until the coordinator lists every one of ``site_ids`` as online."""
        wanted = set(site_ids)
        assert self.coordinator is not None
        with self.admin() as admin:

            def online() -> bool:
                for sid in wanted:
                    if sid in self.sites and not self.sites[sid].alive():
                        raise ClusterError(f"site {sid} exited:\n{self.sites[sid].log_tail()}")
                return wanted <= {s.site_id for s in admin.sites() if s.online}

            self.wait_for(online, self.coordinator, timeout_s, f"see sites {sorted(wanted)} online")

    def wait_for(self, probe: Any, proc: ManagedProcess, timeout_s: float, what: str) -> Any:
        """``probe()`` once it is truthy; ClusterError (with ``proc``'s log) if ``proc``
        exits first or ``timeout_s`` passes, saying what it did not ``what``."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            result = probe()
            if result:
                return result
            if not proc.alive():
                raise ClusterError(f"{proc.name} exited before it could {what}:\n{proc.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{proc.name} did not {what} within {timeout_s:g} s:\n{proc.log_tail()}"
                )
            time.sleep(delay)  # polling a readiness condition, with a deadline
            delay = min(delay * 1.5, 0.5)

    def stop(self) -> None:
        """Stop every process: sites first, then the coordinator."""
        try:
            for proc in self.sites.values():
                proc.signal(signal.SIGTERM)
            for proc in self.sites.values():
                proc.stop()
            if self.coordinator is not None:
                self.coordinator.stop()
        finally:
            if self._lifeline is not None:  # what still follows it stops: its descriptors go
                self._lifeline.cut()
                self._lifeline = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_ready(path: Path, pid: int) -> dict[str, Any] | None:
    try:
        info: dict[str, Any] = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return info if info.get("pid") == pid else None
