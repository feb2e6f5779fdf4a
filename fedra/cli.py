"""The ``fedra`` command: coordinator, site, run submit/status/watch/cancel, sites, demo,
bench compare."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from fedra import lifetime, logformat
from fedra.config import READY_FILE, ConfigError, check_host_port, load_toml
from fedra.metrics import format_bytes, format_metric

if TYPE_CHECKING:
    from fedra.pki import TlsFiles
from fedra.protos.v1 import admin_pb2
from fedra.runspec import runspec_from_toml

DEFAULT_ADDRESS = "127.0.0.1:50051"
_FINISHED = ("completed", "failed", "cancelled")
MAX_ROUND = 2**32 - 1  # round numbers are uint32 on the wire


def check_round(value: int, name: str) -> int:
    if not 0 <= value <= MAX_ROUND:
        raise ConfigError(f"{name}: must be a round number from 0 to {MAX_ROUND}, got {value}")
    return value


def _redact_url(url: str) -> str:
    """A database URL without its password, for error messages."""
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _check_db_url(url: str) -> None:
    """Refuse a --db that SQLAlchemy cannot parse, has no driver for, or (a database
    server's) cannot connect to, before anything is made in the state directory."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, DBAPIError
    from sqlalchemy.pool import NullPool

    try:
        parsed = make_url(url)
        parsed.get_dialect().import_dbapi()
    except (ArgumentError, ValueError) as exc:
        raise ConfigError(f"--db: {_first_line(exc)}, got {_redact_url(url)!r}") from None
    except ImportError as exc:
        raise ConfigError(f"--db: no driver for {_redact_url(url)!r}: {exc}") from None
    if parsed.get_backend_name() == "sqlite":
        return  # a file: connecting would make it (the daemon reports what goes wrong there)
    engine = create_engine(parsed, poolclass=NullPool)
    try:
        engine.connect().close()
    except DBAPIError as exc:  # no server there, refused credentials, no such database...
        raise ConfigError(f"--db: {_first_line(exc)}") from None
    finally:
        engine.dispose()


def _region(args: argparse.Namespace) -> Any:
    """--upstream and its flags: the RegionConfig, or None; ConfigError naming the flag."""
    given = [f for f in ("region_id", "upstream_tls_dir") if getattr(args, f)]
    for flag in ("region_task", "upstream_insecure", "region_secagg"):
        if getattr(args, flag):
            given.append(flag)
    if not args.upstream:
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')}: needs --upstream")
        return None
    check_host_port(args.upstream, "--upstream")
    from fedra.region import RegionConfig

    return RegionConfig(
        upstream=args.upstream,
        region_id=args.region_id or "",
        tasks=tuple(args.region_task),
        state_dir=Path(args.state_dir) / "upstream",
        tls_dir=Path(args.upstream_tls_dir) if args.upstream_tls_dir else None,
        insecure=args.upstream_insecure,
        sites_per_round=args.region_sites,
        min_sites=args.region_min_sites,
        secagg=args.region_secagg,
    )


def _cmd_coordinator(args: argparse.Namespace) -> int:
    # The flags first: the daemon's modules take seconds to import.
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: must be from 0 to 65535 (0 picks a free port), got {args.port}")
    for flag in ("heartbeat_s", "site_timeout_s", "poll_timeout_s", "decline_hold_s"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(
                f"--{flag.replace('_', '-')}: must be a finite number > 0, got {value}"
            )
    if args.db:
        _check_db_url(args.db)
    admin_port = _admin_port(args.admin_port, args.port)
    from sqlalchemy.exc import DBAPIError

    from fedra.coordinator.engine import EngineSettings
    from fedra.coordinator.limits import EdgeLimits
    from fedra.coordinator.server import STATE_LOCK_FILE, CoordinatorConfig, serve
    from fedra.storage.migrate import SchemaTooNew

    settings = EngineSettings(
        heartbeat_interval_s=args.heartbeat_s,
        site_timeout_s=args.site_timeout_s,
        poll_timeout_s=args.poll_timeout_s,
        inline_model_bytes=args.inline_model_bytes,
        small_update_bytes=args.small_update_bytes,
        decline_hold_s=args.decline_hold_s,
    )
    window = {} if args.stream_window_mb is None else {"stream_window_mb": args.stream_window_mb}
    config = CoordinatorConfig(
        state_dir=Path(args.state_dir),
        host=args.host,
        port=args.port,
        db_url=args.db or "",
        max_workers=args.workers,
        engine=settings,
        limits=EdgeLimits(
            calls_per_site=args.max_calls_per_site,
            calls_per_admin=args.max_calls_per_admin,
            stream_idle_s=args.stream_idle_s,
        ),
        tls_dir=Path(args.tls_dir) if args.tls_dir else None,
        insecure=args.insecure,
        http=args.http or "",
        track=tuple(args.track),
        admin_port=admin_port,
        region=_region(args),
        **window,
    )
    made_state_dir = not config.state_dir.exists()
    try:
        serve(config)
    except DBAPIError as exc:  # e.g. the schema cannot be made (a database user's rights)
        if made_state_dir:  # leave no state directory behind that only this start made
            with contextlib.suppress(OSError):
                (config.state_dir / STATE_LOCK_FILE).unlink(missing_ok=True)
                config.state_dir.rmdir()
        name = "--db" if args.db else f"--state-dir: database {config.database_url}"
        raise ConfigError(f"{name}: {_first_line(exc)}") from None
    except SchemaTooNew as exc:
        name = "--db" if args.db else f"--state-dir: database {config.database_url}"
        raise ConfigError(f"{name}: {exc}") from None
    except RuntimeError as exc:  # grpc: the port is taken, or the host is not this machine's
        if not str(exc).startswith("Failed to bind"):
            raise
        raise ConfigError(
            f"--port: cannot listen on {args.host}:{args.port} (in use, or not an address "
            "of this machine)"
        ) from None
    return 0


def _site_config(args: argparse.Namespace) -> Any:
    from fedra.client.config import SiteConfig

    path = getattr(args, "sub_config", None) or args.config
    if not path:
        raise ConfigError("--config: required (the site's site.toml)")
    config = SiteConfig.load(path)
    if config.state_dir is None:
        raise ConfigError(f"{path}: state_dir: not set, so this site keeps no runs")
    return config


def _cmd_site_runs(args: argparse.Namespace) -> int:
    from fedra.client.policy import list_runs

    config = _site_config(args)
    runs = list_runs(config.state_dir)
    if args.json:
        from dataclasses import asdict

        print(json.dumps([{**asdict(r), "approved": ok} for r, ok in runs], indent=2))
        return 0
    if not runs:
        print(f"no run has asked {config.site_id} for work yet")
        return 0
    print(f"{'run':<14} {'state':<9} {'task':<32} asks")
    for r, ok in runs:
        train = ", ".join(f"{k} {v}" for k, v in r.train.items() if k != "params" and v)
        asks = f"{train}; codec {r.codec}; {'secagg' if r.secagg else 'no secagg'}"
        print(f"{r.run_id:<14} {'approved' if ok else 'pending':<9} {r.task:<32} {asks}")
    print(f"(approve mode: {config.policy.approve}; `fedra site approve RUN_ID` approves one)")
    return 0


def _cmd_site_approve(args: argparse.Namespace) -> int:
    import getpass

    from fedra.audit import AUDIT_FILE, AuditLog
    from fedra.client.policy import approve

    config = _site_config(args)
    who = f"operator {getpass.getuser()}"
    request = approve(config.state_dir, args.run_id, who)
    AuditLog(config.state_dir / AUDIT_FILE).append(
        "run.approve", who, run=request.run_id, task=request.task
    )
    print(f"approved run {request.run_id} ({request.task}) at {config.site_id}: its next "
          "task here is taken")  # fmt: skip
    return 0


def _cmd_site(args: argparse.Namespace) -> int:
    if not args.config:
        raise ConfigError("--config: required (the site's site.toml)")
    if args.coordinator:
        check_host_port(args.coordinator, "--coordinator")
    import torch

    from fedra.client.agent import SiteAgent
    from fedra.client.config import SiteConfig

    config = SiteConfig.load(args.config)
    if args.coordinator:
        config = SiteConfig.from_toml({**load_toml(args.config), "coordinator": args.coordinator})
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.parallel.launches_world:
        from fedra.client.launch import launch_world

        if args.coordinator:
            raise ConfigError(
                "--coordinator: not supported with [parallel] nproc > 1 or nnodes > 1; "
                "edit the file"
            )
        launch_world(config, Path(args.config))
        return 0
    agent = SiteAgent(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.shutdown())
    agent.run()
    return 0


def _admin_port(value: str | None, port: int) -> int | None:
    """--admin-port: a port (0: a free one), ``none``, or by default the one after --port."""
    if value is None:
        return 0 if port in (0, 65535) else port + 1
    if value.strip().lower() in ("none", "off"):
        return None
    try:
        admin_port = int(value)
    except ValueError:
        raise ConfigError(f"--admin-port: a port from 0 to 65535 or none, got {value!r}") from None
    if not 0 <= admin_port <= 65535:
        raise ConfigError(f"--admin-port: must be from 0 to 65535 or none, got {admin_port}")
    if admin_port == port != 0:
        raise ConfigError(f"--admin-port: {admin_port} is --port too; give another, or none")
    return admin_port


class NotRunning(ConfigError):
    """No readiness file in the state directory: the coordinator is not (yet) serving."""


def _address(args: argparse.Namespace) -> str:
    if args.coordinator:
        return check_host_port(str(args.coordinator), "--coordinator")
    if getattr(args, "state_dir", None):
        ready = Path(args.state_dir) / READY_FILE
        try:
            info = json.loads(ready.read_text())
            # The admin port where there is one: its process answers while rounds run.
            return str(info.get("admin_address") or info["address"])
        except FileNotFoundError as exc:
            raise NotRunning(f"{ready}: not found; is the coordinator running?") from exc
    from_env = os.environ.get("FEDRA_COORDINATOR")
    return check_host_port(from_env, "$FEDRA_COORDINATOR") if from_env else DEFAULT_ADDRESS


def _address_and_source(args: argparse.Namespace) -> str:
    """'ADDRESS (where it came from)' for an admin command's error; '' if there is none."""
    if not hasattr(args, "coordinator"):
        return ""
    try:
        address = _address(args)
    except ConfigError:
        return ""
    if args.coordinator:
        source = "--coordinator"
    elif getattr(args, "state_dir", None):
        source = f"from {Path(args.state_dir) / READY_FILE}"
    elif os.environ.get("FEDRA_COORDINATOR"):
        source = "$FEDRA_COORDINATOR"
    else:
        source = "the default: give --coordinator or set $FEDRA_COORDINATOR"
    return f"{address} ({source})"


def _serves_insecure(state_dir: Path) -> bool:
    """Whether the coordinator running on ``state_dir`` says it serves without TLS."""
    try:
        ready = json.loads((state_dir / READY_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(ready, dict) and ready.get("insecure") is True


def _admin_tls(args: argparse.Namespace) -> TlsFiles | None:
    """The admin's credentials: --tls-dir, $FEDRA_TLS_DIR, or a local cluster's own admin."""
    from fedra import pki

    if args.insecure:
        return None
    folder = args.tls_dir or os.environ.get("FEDRA_TLS_DIR")
    if not folder and args.state_dir:
        local = Path(args.state_dir) / "pki" / "admins" / "admin"  # what LocalCluster provisions
        folder = str(local) if local.is_dir() else None
        if folder is None and not args.coordinator and _serves_insecure(Path(args.state_dir)):
            return None  # the daemon there says it serves without TLS (localhost development)
    if not folder:
        raise ConfigError(
            "--tls-dir: give an admin folder from `fedra provision` "
            "(or set FEDRA_TLS_DIR), or --insecure for an insecure coordinator"
        )
    return pki.load_folder(Path(folder))


def _admin(args: argparse.Namespace, address: str | None = None):  # type: ignore[no-untyped-def]
    from fedra.admin import AdminClient

    return AdminClient(address or _address(args), tls=_admin_tls(args))


def _cmd_wan(args: argparse.Namespace) -> int:
    from fedra.wan import Link, WanProxy

    try:
        link = Link(args.bandwidth_mbit, args.latency_ms, args.loss_pct)
    except ValueError as exc:
        raise ConfigError("--" + str(exc).replace("_", "-", 1)) from exc
    check_host_port(args.target, "--target")
    listen = args.listen if ":" in args.listen else f":{args.listen}"  # a bare port
    host, _, port = check_host_port(
        "127.0.0.1" + listen if listen.startswith(":") else listen,
        "--listen",
        allow_port_zero=True,
    ).rpartition(":")
    proxy = WanProxy(args.target, link, host=host, port=int(port))
    proxy.start()
    loss = f", {link.loss_pct:g}% loss: {link.bytes_per_s * 8 / 1e6:.3g} Mbit/s per flow"
    print(
        f"{proxy.address} -> {args.target}: {link.bandwidth_mbit:g} Mbit/s, {link.latency_ms:g} ms"
        + (loss if link.loss_pct else ""),
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    proxy.stop()
    return 0


def _cmd_provision(args: argparse.Namespace) -> int:
    from fedra import pki

    out = Path(args.out)
    if args.add:
        made = [pki.add_participant(out, args.role, name, hosts=args.host) for name in args.add]
    else:
        hosts = args.host or ["localhost", "127.0.0.1"]
        made = pki.provision(out, coordinator_hosts=hosts, sites=args.site, admins=args.admin)
    for p in made:
        print(f"{p.role:<12} {p.name:<24} {p.folder}")
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    import getpass

    from fedra import pki
    from fedra.audit import AUDIT_FILE, AuditLog
    from fedra.coordinator.server import DENY_LIST

    state_dir = Path(args.state_dir)
    path = state_dir / DENY_LIST
    cert = Path(args.cert)
    pem = (cert / "cert.pem" if cert.is_dir() else cert).read_bytes()
    serial = pki.revoke(path, pem)
    who = pki.identity_of(pem)
    AuditLog(state_dir / AUDIT_FILE).append(
        "cert.revoke", f"operator {getpass.getuser()}", serial=format(serial, "x"),
        role=who.role if who else "", name=who.name if who else "",
    )  # fmt: skip
    print(f"revoked {args.cert}: the coordinator refuses it from its next call ({path})")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from fedra import audit

    if (args.state_dir is None) == (args.config is None):
        raise ConfigError("give --state-dir (a coordinator's) or --config (a site's site.toml)")
    if args.head and not args.verify:
        raise ConfigError("--head: only with --verify")
    if args.config is not None:
        from fedra.client.config import SiteConfig

        site = SiteConfig.load(args.config)
        if site.state_dir is None:
            raise ConfigError(f"{args.config}: state_dir: not set, so this site keeps no audit log")
        path = site.state_dir / audit.AUDIT_FILE
    else:
        path = Path(args.state_dir) / audit.AUDIT_FILE
    try:
        entries = audit.verify(path, args.head) if args.verify else audit.read(path)
    except audit.AuditError as exc:
        print(f"fedra audit: {path}: broken: {exc}", file=sys.stderr)
        return 1
    for e in entries:
        if args.json:
            print(json.dumps(e.as_dict(), sort_keys=True))
        else:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.time))
            data = " ".join(f"{k}={v}" for k, v in e.data.items())
            print(f"{e.seq:>6}  {when}Z  {e.event:<16}  {e.who or '-':<20}  {data}")
    if args.verify:
        seq, head = audit.head_of(entries)
        print(f"{path}: {len(entries)} entries, chain intact; head seq {seq} hash {head}",
              file=sys.stderr if args.json else sys.stdout)  # fmt: skip
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    address = _address(args)  # a bad --coordinator before the file's own errors
    doc = load_toml(args.spec)  # its own errors name the file
    try:
        spec = runspec_from_toml(doc)
    except ValueError as exc:  # a key or value of the spec: said with the file it is in
        raise ConfigError(f"{args.spec}: {exc}") from None
    with _admin(args, address) as admin:
        submitted = admin.submit_run(spec)
    print(submitted.run_id)
    for warning in submitted.warnings:
        print(f"fedra: warning: {warning}", file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    check_round(args.from_round, "--from-round")
    with _admin(args) as admin:
        # The text names no site but a changed one: counts do (a round of thousands of
        # sites is a few hundred bytes instead of a megabyte).
        summary = args.summary or not args.json
        status = admin.status(args.run_id, first_round=args.from_round, summary=summary)
    if args.json:
        print(json.dumps(status_to_dict(status), indent=2))
    else:
        print(format_status(status))
    return 0


FINAL_STATES = ("completed", "failed", "cancelled")
# A watch of an address that never answered (a typo) gives up after this, or --reconnect-s
# if shorter: riding out restarts is for a coordinator it reached, or one whose state
# directory it reads (a restarting daemon writes coordinator.json once it serves).
FIRST_CONTACT_S = 10.0
# A watch outlives a coordinator restart: these mean the daemon is away, not that it refused.
_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def _state_line(status: admin_pb2.RunStatus) -> str:
    return f"run {status.run_id}: {status.state}" + (f" ({status.reason})" if status.reason else "")


class _Progress:
    """The open round's progress of ``run watch``: at a terminal one line rewritten in
    place (at most 10 times a second) with a bar of the updates in, otherwise a plain
    line when its counts changed, at most one every ``PLAIN_EVERY_S`` (a round of
    thousands of sites changes thousands of times: a log file gets a line every few
    seconds, not one per update). A run waiting for sites to open its round says so the
    same way, with how long it has waited."""

    PLAIN_EVERY_S = 5.0
    BAR = 24  # characters of the bar

    def __init__(self) -> None:
        self.live = sys.stdout.isatty()
        self.last = ""  # what the last line said, less its clock
        self.printed_at = -float("inf")
        self.shown = False  # a live line is on screen (ended before anything else prints)

    def update(self, r: admin_pb2.RoundStatus) -> None:
        counts, clock = format_open_round(r, time.time())
        done = by_status(r)["accepted"]
        self._show(counts, clock, progress_bar(done, sampled(r), self.BAR))

    def waiting(self, reason: str) -> None:
        """The run's reason while no round is open (e.g. waiting for sites)."""
        words, _, clock = reason.rpartition(", for ")  # its clock changes every second
        # "next round 3: waiting ...": never read as a committed round's "round 3 ..." line
        text = f"next {words or reason}" if reason.startswith("round ") else words or reason
        self._show(text, f"for {clock}" if words else "", "")

    def _show(self, text: str, clock: str, bar: str) -> None:
        now = time.monotonic()
        every_s = 0.1 if self.live else self.PLAIN_EVERY_S
        if text == self.last or now - self.printed_at < every_s:
            return
        line = ", ".join(x for x in (text, clock) if x)
        if self.live:
            width = shutil.get_terminal_size().columns - 1  # a wrapped line is not rewritten
            print(f"\r{(bar + ' ' if bar else '') + line:.{max(width, 20)}}\033[K", end="")
            sys.stdout.flush()
            self.shown = True
        else:
            print(line, flush=True)
        self.last, self.printed_at = text, now

    def end(self) -> None:
        if self.shown:
            print("\r\033[K", end="", flush=True)
            self.shown = False


def progress_bar(done: int, total: int, width: int) -> str:
    """``[#####-----]  5/10``: ``done`` of ``total`` in ``width`` characters, plain ASCII."""
    filled = min(width, round(width * done / total)) if total > 0 else 0
    return f"[{'#' * filled}{'-' * (width - filled)}] {done:>{len(str(total))}}/{total}"


def format_open_round(r: admin_pb2.RoundStatus, now: float) -> tuple[str, str]:
    """An open round's progress: its sites' counts and bytes, and how long it has been
    open with the rate its bytes moved at."""
    counted = by_status(r)
    failed = f", {counted['failed']} failed" if counted["failed"] else ""
    if counted["declined"]:  # by the sites' own policies
        failed += f", {counted['declined']} declined"
    attempt = f" (attempt {r.attempt})" if r.attempt > 1 else ""
    moved = moved_bytes(r)
    counts = (
        f"open round {r.number}{attempt}: {counted['accepted']}/{sampled(r)} "
        f"updates in, {counted['downloaded']} training or uploading, "
        f"{counted['assigned']} yet to start{failed}, {moved / 1e6:.3f} MB moved"
    )
    open_s = max(0.0, now - r.opened_unix_s)
    rate = f" ({moved / 1e6 / open_s:.2f} MB/s)" if open_s >= 1 and moved else ""
    return counts, f"{open_s:.0f} s so far{rate}"


def _cmd_watch(args: argparse.Namespace) -> int:
    from fedra.retry import Backoff

    if not args.reconnect_s >= 0:
        raise ConfigError(f"--reconnect-s: must be >= 0, got {args.reconnect_s}")
    shown: set[int] = set()  # the committed rounds printed
    seen: dict[int, admin_pb2.RoundStatus] = {}  # every round, as last sent
    last_state = ""
    status = None
    backoff = Backoff(base_s=0.5, cap_s=5.0)
    away_since: float | None = None
    reached = False  # until the coordinator first answers, it was never "lost"
    starting = False  # its state dir says it is not serving yet: wait the whole time
    progress = _Progress()
    while True:
        where = ""
        try:
            # A fresh client each time: the address is read again (a restarted daemon may
            # listen elsewhere) and no stale connection backoff delays the reconnect.
            address = _address(args)
            where = f" at {address}"
            with _admin(args, address) as admin:
                # Counts, not rows: the lines name no site.
                watched = admin.watch(args.run_id, changed_rounds_only=True, summary=True)
                for status in watched:
                    reached = True
                    if away_since is not None:
                        away = time.monotonic() - away_since
                        print(f"run watch: reconnected after {away:.1f} s", file=sys.stderr)
                    away_since = None
                    backoff.reset()
                    final = status.state in FINAL_STATES
                    if status.state != last_state and not final:  # before its rounds
                        progress.end()
                        print(_state_line(status), flush=True)
                        last_state = status.state
                    elif status.state == "running" and status.reason:
                        progress.waiting(status.reason)  # no round open: why, for how long
                    for r in status.rounds:
                        seen[r.number] = r  # its latest: late downloads, lost tasks
                        if r.status == "committed" and r.number not in shown:
                            shown.add(r.number)
                            progress.end()
                            print(format_round(r), flush=True)
                        elif r.status == "open" and not final:
                            progress.update(r)
            reached = True  # the stream ended without an error: someone answered
            progress.end()
            if status is not None and status.state in FINAL_STATES:
                # After the last rounds: the daemon ends the stream after the messages
                # that hold them (a long run's rounds may span several).
                if seen:
                    print(format_totals([seen[n] for n in sorted(seen)]), flush=True)
                print(_state_line(status), flush=True)
                return 0 if status.state == "completed" else 1
            why = "it closed the stream"  # a daemon stopping ends its watches
        except grpc.RpcError as exc:
            if exc.code() not in _AWAY:
                raise
            why = exc.details() or exc.code().name
        except NotRunning as exc:  # a stopped daemon removes its readiness file
            why, starting = str(exc), True
        progress.end()
        away_since = away_since if away_since is not None else time.monotonic()
        never = not reached and not starting  # an address that never answered: a typo?
        limit_s = min(args.reconnect_s, FIRST_CONTACT_S) if never else args.reconnect_s
        left = limit_s - (time.monotonic() - away_since)
        if left <= 0:
            what = (
                f"the coordinator{where} is still unreachable"
                if reached
                else f"cannot reach the coordinator{where}"
            )
            print(
                f"run watch: {what} after {limit_s:g} s ({why}); giving up",
                file=sys.stderr,
            )
            return 2
        delay = min(backoff.next_delay_s(), left)  # the last try comes at the deadline
        what = f"lost the coordinator{where}" if reached else f"cannot reach the coordinator{where}"
        print(
            f"run watch: {what} ({why}); reconnecting in {delay:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(delay)


def _cmd_cancel(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        print(f"run {args.run_id}: {admin.cancel(args.run_id)}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        runs = admin.runs()
    print(format_runs(runs))
    return 0


def format_runs(runs: list[admin_pb2.RunStatus]) -> str:
    width = max([len("run"), *(len(r.run_id) for r in runs)])
    tasks = max([len("task"), *(len(r.spec.task) for r in runs)])
    lines = [f"{'run':<{width}}  {'state':<10} {'rounds':>9}  {'task':<{tasks}}  name"]
    for r in runs:
        done = f"{r.rounds_completed}/{r.spec.rounds}"
        lines.append(
            f"{r.run_id:<{width}}  {r.state:<10} {done:>9}  {r.spec.task:<{tasks}}  {r.spec.name}"
        )
    return "\n".join(lines)


def _cmd_export(args: argparse.Namespace) -> int:
    if args.round is not None:
        check_round(args.round, "--round")
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out: {out} is a directory; give a file name")
    if not out.parent.is_dir():  # checked before connecting, not when the download ends
        raise ConfigError(f"--out: directory {out.parent} does not exist")
    with _admin(args) as admin:
        size = admin.export_to_file(args.run_id, out, args.round)
    print(f"wrote {args.out} ({size} bytes)")
    return 0


def _bytes_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more bytes, got {value}")
    return value


def _page_size(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 5000:
        raise argparse.ArgumentTypeError(f"must be from 1 to 5000, got {value}")
    return value


def _cmd_sites(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        if args.summary:
            total, online = admin.site_counts()
            if args.json:
                print(json.dumps({"total": total, "online": online}))
            else:
                print(f"{total} sites registered, {online} online")
            return 0
        if args.json:
            sites = admin.sites(args.page_size)
            dicts = [MessageToDict(s, preserving_proto_field_name=True) for s in sites]
            print(json.dumps(dicts, indent=2))
            return 0
        # Page by page, each printed as it arrives: thousands of sites never wait for all.
        for number, page in enumerate(admin.site_pages(args.page_size)):
            print(format_sites(list(page.sites), time.time(), header=number == 0), flush=True)
            if not page.next_page_token:
                print(f"{page.total} sites registered, {page.online} online")
    return 0


def format_sites(sites: list[admin_pb2.Site], now: float, header: bool = True) -> str:
    lines = [f"{'site':<20} {'state':<8} {'last seen':>12}  tasks"] if header else []
    for s in sites:
        state = "revoked" if s.revoked else "online" if s.online else "offline"
        seen = f"{now - s.last_seen_unix_s:.1f} s ago"
        lines.append(f"{s.site_id:<20} {state:<8} {seen:>12}  {', '.join(s.tasks)}")
    return "\n".join(lines)


def _cmd_demo(args: argparse.Namespace) -> int:
    from fedra.demo import DemoOptions, run_demo

    options = DemoOptions(
        state_dir=Path(args.state_dir) if args.state_dir else None,
        out=Path(args.out) if args.out else None,
        rounds=args.rounds,
        sites=args.sites,
        strategy=args.strategy,
        alpha=args.alpha,
        partition_seed=args.partition_seed,
    )
    return run_demo(options)


def _cmd_bench_compare(args: argparse.Namespace) -> int:
    from fedra.compare import CompareConfig, run_compare, write_report
    from fedra.compare_report import headline_text, require_matplotlib
    from fedra.local import ClusterError

    require_matplotlib()
    config = CompareConfig.build(
        quick=args.quick,
        out=Path(args.out) if args.out else None,
        steps=args.steps,
        h_values=tuple(args.h) if args.h else None,
        overlap_h=tuple(args.overlap_h) if args.overlap_h is not None else None,
        only=tuple(args.only) if args.only else None,
        sites=args.sites,
        bandwidth_mbit=args.bandwidth_mbit,
        latency_ms=args.latency_ms,
        target_loss=args.target_loss,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        price_compute_hour=args.price_compute_hour,
        price_gb=args.price_gb,
    )
    try:
        report = run_compare(config, log=lambda line: print(line, flush=True))
    except ClusterError as exc:  # a process did not come up: its log tail says why
        print(f"fedra: error: {exc}", file=sys.stderr)
        return 1
    for path in write_report(report, config.out):
        print(f"wrote {path}")
    print(headline_text(report))
    return 0 if all(c["state"] == "completed" for c in report["configurations"]) else 1


def status_to_dict(status: admin_pb2.RunStatus) -> dict[str, Any]:
    """The status as JSON-ready data; 64-bit integers stay numbers (protobuf's JSON makes
    them strings)."""
    data = _int64_as_int(status, _message_dict(status))
    data.pop("more_rounds_follow", None)  # how a watch's stream is cut, not about the run
    return data


_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def _int64_as_int(message: Message, data: dict[str, Any]) -> dict[str, Any]:
    for field in message.DESCRIPTOR.fields:
        if field.name not in data or (
            field.message_type is not None and field.message_type.GetOptions().map_entry
        ):
            continue
        value = getattr(message, field.name)
        repeated = field.is_repeated
        if field.type in _INT64_TYPES:
            data[field.name] = [int(v) for v in value] if repeated else int(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if repeated:
                data[field.name] = [
                    _int64_as_int(m, d) for m, d in zip(value, data[field.name], strict=True)
                ]
            else:
                data[field.name] = _int64_as_int(value, data[field.name])
    return data


def _message_dict(message: Message) -> dict[str, Any]:
    return MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def format_round(r: admin_pb2.RoundStatus) -> str:
    metrics = "  ".join(
        f"{k} {format_metric(k, v)}" for k, v in sorted(r.metrics.items()) if k != "compute_s"
    )
    idle = (
        f"idle {min(1.0, r.site_idle_s / r.duration_s):4.0%}"
        if r.status == "committed" and r.number > 0 and r.duration_s > 0
        else " " * 9
    )
    lost = f"  lost {format_bytes(r.lost_bytes)}" if r.lost_bytes else ""
    return (
        f"round {r.number:>3}  {r.updates}/{sampled(r)} sites  "
        f"{moved_bytes(r) / 1e6:8.3f} MB  {r.duration_s:6.2f} s  {idle}  "
        f"{metrics}{lost}"
    ).rstrip()


def sampled(r: admin_pb2.RoundStatus) -> int:
    """How many sites the round sampled, from a summary or a whole round (a daemon that
    predates sampled_count sends only the list)."""
    return r.sampled_count or len(r.sampled_sites)


def by_status(r: admin_pb2.RoundStatus) -> Counter[str]:
    """The round's current attempt's participations by status, from a summary or a
    whole round (a daemon that predates participation_counts sends only the rows)."""
    if r.participation_counts or not r.participations:
        return Counter(dict(r.participation_counts))
    return Counter(p.status for p in r.participations if p.attempt == r.attempt)


def moved_bytes(r: admin_pb2.RoundStatus) -> int:
    """All a round's bytes on the wire: its completed transfers and its cut ones."""
    return r.bytes_down + r.bytes_up + r.cut_bytes


def format_totals(rounds: Sequence[admin_pb2.RoundStatus]) -> str:
    """What the rounds moved, what of it was lost, and how long the sites sat idle."""
    wire = sum(moved_bytes(r) for r in rounds)
    lost = sum(r.lost_bytes for r in rounds)
    timed = [r for r in rounds if r.status == "committed" and r.number > 0 and r.duration_s > 0]
    line = f"{format_bytes(wire)} on the wire"
    if wire:
        line += f", {format_bytes(lost)} ({lost / wire:.0%}) of it for work that did not count"
    if timed:
        idle = sum(r.site_idle_s for r in timed) / sum(r.duration_s for r in timed)
        line += f"; sites sat idle {min(1.0, idle):.0%} of their rounds"
    return line


def format_status(s: admin_pb2.RunStatus) -> str:
    lines = [
        f"run {s.run_id} ({s.spec.name}): {s.state}" + (f" - {s.reason}" if s.reason else ""),
        *(
            ["WARNING: the coordinator runs WITHOUT TLS (--insecure)"]
            if s.coordinator_insecure
            else []
        ),
        f"task {s.spec.task}, strategy {s.spec.strategy}, "
        f"{s.rounds_completed}/{s.spec.rounds} rounds",
        *(  # a site whose code, data or software changed mid-run
            f"WARNING: site {p.site_id}'s provenance changed from round {p.since_round}: "
            f"task source {p.provenance.task_source_sha256[:12]}, data "
            f"{p.provenance.data_fingerprint[:19]} (--json: provenance)"
            for p in s.provenance.sites
            if p.changed
        ),
    ]
    for r in s.rounds:
        line = format_round(r)
        if r.status != "committed":
            line += f"  [{r.status}, attempt {r.attempt}]"
        lines.append(line)
    if s.rounds:
        first = "" if s.rounds[0].number == 0 else f" (rounds {s.rounds[0].number} on)"
        lines.append(format_totals(s.rounds) + first)
    return "\n".join(lines)


class _Defaults(argparse.HelpFormatter):
    """Help that shows each option's default, unless its help already says it or it has
    none worth showing (None, False, an empty string or list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if (
            "default" in help_text
            or default in (None, False, "", [], argparse.SUPPRESS)
            or not action.option_strings
        ):
            return help_text
        return f"{help_text} (default: %(default)s)" if help_text else "default: %(default)s"


class _Parser(argparse.ArgumentParser):
    """fedra's parsers, its subcommands' included (argparse makes those of the same class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Defaults)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fedra", description=__doc__)
    p.add_argument(
        "--log-level",
        default=os.environ.get("FEDRA_LOG_LEVEL", "info"),
        help="debug, info, warning or error (or $FEDRA_LOG_LEVEL)",
    )
    p.add_argument(
        "--log-format",
        choices=logformat.FORMATS,
        default=os.environ.get(logformat.ENV, "text"),
        help="text lines, or one JSON object a line with time, level, component, message "
        f"and the run, round and site it is about (default: ${logformat.ENV} or text)",
    )
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("coordinator", help="run the coordinator daemon")
    c.add_argument(
        "--state-dir", required=True, help="database, blobs and coordinator.json live here"
    )
    c.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves every interface")
    c.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    c.add_argument(
        "--admin-port", metavar="PORT|none", default=None,
        help="the admin port, served by a process of its own that reads the database, so "
        "operators' calls never wait behind the rounds (default: --port + 1; with --port 0, "
        "a free port; written to coordinator.json as admin_address); none: admin calls on "
        "--port only",
    )  # fmt: skip
    c.add_argument("--db", help="SQLAlchemy URL (default: SQLite file in the state directory)")
    c.add_argument("--tls-dir", help="the coordinator's folder from `fedra provision` (mTLS)")
    c.add_argument(
        "--insecure", action="store_true", help="plaintext, no identities: localhost development"
    )
    c.add_argument("--heartbeat-s", type=float, default=5.0, help="how often busy sites check in")
    c.add_argument(
        "--site-timeout-s", type=float, default=20.0, help="a site silent this long is offline"
    )
    c.add_argument("--poll-timeout-s", type=float, default=20.0, help="longest long poll")
    c.add_argument(
        "--decline-hold-s", type=float, default=60.0,
        help="a site whose policy declined a run's task is not asked again for that run "
        "for this long",
    )  # fmt: skip
    c.add_argument(
        "--inline-model-bytes", type=_bytes_count, default=64 * 1024,  # EngineSettings'
        help="a model this small goes out with its task in the poll's reply: no download "
        "call (0: sites always download)",
    )  # fmt: skip
    c.add_argument(
        "--small-update-bytes", type=_bytes_count, default=64 * 1024,  # EngineSettings'
        help="an update this small is kept in the database with its accept instead of as "
        "a spool file (0: every update a file)",
    )  # fmt: skip
    c.add_argument(
        "--workers",
        type=int,
        default=32,  # coordinator.server.DEFAULT_WORKERS
        help="threads for the blocking steps of calls (database, hashing, folding); "
        "waiting calls hold none, so it does not grow with the sites",
    )
    c.add_argument(
        "--stream-window-mb",
        type=float,
        help="what one upload may buffer in the coordinator, MiB (default 8; it also caps a "
        "site's upload rate at window / round-trip time); 0: sized by gRPC's bandwidth "
        "probing, unbounded",
    )
    c.add_argument(
        "--max-calls-per-site",
        type=int,
        default=8,
        help="calls one site certificate may have in flight; past it a call is refused "
        "with UNAVAILABLE (the site retries with backoff)",
    )
    c.add_argument(
        "--max-calls-per-admin",
        type=int,
        default=32,
        help="the same for an admin certificate (and, with --insecure, for each connection)",
    )
    c.add_argument(
        "--stream-idle-s",
        type=float,
        default=60.0,
        help="an upload stream on which nothing arrives this long is ended (raise it for "
        "links slower than a chunk per this many seconds)",
    )
    c.add_argument(
        "--http", metavar="HOST:PORT",
        help="serve Prometheus metrics at /metrics and the status page at / of this address "
        "(plain HTTP on loopback; elsewhere TLS for admin certificates, needs --tls-dir; "
        "port 0: a free port, written to coordinator.json as http_address)",
    )  # fmt: skip
    c.add_argument(
        "--track", action="append", default=[], metavar="BACKEND[=WHERE]",
        help="write each run's spec and committed rounds to tensorboard[=DIR] (default "
        "STATE_DIR/tensorboard) or mlflow[=URI] (default sqlite:///STATE_DIR/mlruns/mlflow.db); "
        "repeat for both; needs the tracking extra (default: none)",
    )  # fmt: skip
    g = c.add_argument_group(
        "a region", "with --upstream this coordinator is one site of the coordinator above "
        "it: each upstream task is a round of its own sites (docs/regions.md)",
    )  # fmt: skip
    g.add_argument("--upstream", metavar="HOST:PORT", help="the coordinator above this one")
    g.add_argument("--region-id", help="this region's site id upstream")
    g.add_argument(
        "--region-task", action="append", default=[], metavar="ENTRY_POINT",
        help="a task the region serves upstream (repeat for more; installed here)",
    )  # fmt: skip
    g.add_argument(
        "--upstream-tls-dir", help="the region's folder from the upstream's `fedra provision`"
    )
    g.add_argument(
        "--upstream-insecure", action="store_true",
        help="plaintext to an --insecure upstream: localhost development",
    )  # fmt: skip
    g.add_argument(
        "--region-sites", type=int, default=0,
        help="sites in each regional round (default 0: every site known to allow the task)",
    )  # fmt: skip
    g.add_argument(
        "--region-min-sites", type=int, default=0,
        help="the fewest a regional round commits with (default 0: --region-sites)",
    )  # fmt: skip
    g.add_argument(
        "--region-secagg", action="store_true",
        help="regional rounds use secure aggregation: this coordinator sees only the sum "
        "of its sites' updates",
    )  # fmt: skip
    c.set_defaults(func=_cmd_coordinator)

    s = sub.add_parser(
        "site", help="run a site agent; or list (runs) and approve (approve) the runs asking it"
    )
    s.add_argument("--config", help="site.toml (required)")
    s.add_argument("--coordinator", help="override the config's coordinator address")
    s.set_defaults(func=_cmd_site)
    site_sub = s.add_subparsers(dest="site_command", metavar="[runs | approve]")
    sr = site_sub.add_parser("runs", help="the runs that asked this site, pending or approved")
    sr.add_argument("--config", dest="sub_config", help="site.toml (required)")
    sr.add_argument("--json", action="store_true", help="as JSON")
    sr.set_defaults(func=_cmd_site_runs)
    sa = site_sub.add_parser("approve", help='approve a run ([policy] approve = "manual")')
    sa.add_argument("run_id", metavar="RUN_ID")
    sa.add_argument("--config", dest="sub_config", help="site.toml (required)")
    sa.set_defaults(func=_cmd_site_approve)

    def admin_args(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--coordinator", help=f"host:port (default $FEDRA_COORDINATOR or {DEFAULT_ADDRESS})"
        )
        q.add_argument(
            "--state-dir", help="read the address from this coordinator's coordinator.json"
        )
        q.add_argument("--tls-dir", help="an admin folder from `fedra provision` ($FEDRA_TLS_DIR)")
        q.add_argument("--insecure", action="store_true", help="for an --insecure coordinator")

    r = sub.add_parser("run", help="submit, inspect and cancel runs")
    rsub = r.add_subparsers(dest="run_command", required=True)
    q = rsub.add_parser("submit", help="submit run.toml; prints the run id")
    q.add_argument("spec")
    q.set_defaults(func=_cmd_submit)
    q = rsub.add_parser("status", help="a run's state and rounds")
    q.add_argument("run_id")
    q.add_argument(
        "--json", action="store_true",
        help="the whole status, every participation of every round, as JSON",
    )  # fmt: skip
    q.add_argument(
        "--summary", action="store_true",
        help="with --json: each round's counts (sampled_count, participation_counts), not "
        "its sites; provenance of the sites that changed only (the text always is)",
    )  # fmt: skip
    q.add_argument("--from-round", type=int, default=0, metavar="N", help="only rounds N and later")
    q.set_defaults(func=_cmd_status)
    q = rsub.add_parser("watch", help="print rounds as they commit until the run ends")
    q.add_argument("run_id")
    q.add_argument(
        "--reconnect-s",
        type=float,
        default=300.0,
        help="how long to keep reconnecting while the coordinator is away (default 300; "
        f"one never reached: {FIRST_CONTACT_S:g} s at most)",
    )
    q.set_defaults(func=_cmd_watch)
    q = rsub.add_parser("cancel", help="cancel a run")
    q.add_argument("run_id")
    q.set_defaults(func=_cmd_cancel)
    q = rsub.add_parser("list", help="all runs")
    q.set_defaults(func=_cmd_list)
    q = rsub.add_parser("export", help="write a committed global model as .safetensors")
    q.add_argument("run_id")
    q.add_argument("--out", required=True)
    q.add_argument("--round", type=int, help="default: the latest committed round")
    q.set_defaults(func=_cmd_export)
    for q in rsub.choices.values():
        admin_args(q)

    q = sub.add_parser("sites", help="sites the coordinator knows")
    q.add_argument("--json", action="store_true")
    q.add_argument("--summary", action="store_true", help="only how many, and how many online")
    q.add_argument("--page-size", type=_page_size, default=1000, help="sites per call (1 to 5000)")
    admin_args(q)
    q.set_defaults(func=_cmd_sites)

    v = sub.add_parser("provision", help="make a CA and a certificate folder per participant")
    v.add_argument("--out", required=True, help="where the CA and the folders go")
    v.add_argument("--host", action="append", default=[], help="coordinator host or IP (repeat)")
    v.add_argument("--site", action="append", default=[], help="a site id (repeat)")
    v.add_argument("--admin", action="append", default=[], help="an admin name (repeat)")
    v.add_argument("--add", action="append", help="add a participant to an existing CA (repeat)")
    v.add_argument(
        "--role", default="site", choices=["site", "admin", "coordinator"], help="of --add"
    )
    v.set_defaults(func=_cmd_provision)

    k = sub.add_parser("revoke", help="refuse a certificate from the coordinator's next call on")
    k.add_argument("--state-dir", required=True, help="the coordinator's state directory")
    k.add_argument("cert", help="the certificate (cert.pem) or participant folder to revoke")
    k.set_defaults(func=_cmd_revoke)

    u = sub.add_parser("audit", help="print and check an audit log (a coordinator's or a site's)")
    u.add_argument("--state-dir", help="a coordinator's state directory")
    u.add_argument("--config", help="a site's site.toml (its state_dir holds its log)")
    u.add_argument("--json", action="store_true", help="one JSON object per entry")
    u.add_argument(
        "--verify", action="store_true",
        help="check the chain: exit 1 naming the first bad entry if one was edited, deleted, "
        "reordered or cut off the end",
    )  # fmt: skip
    u.add_argument("--head", metavar="HASH", help="with --verify: a head hash kept elsewhere")
    u.set_defaults(func=_cmd_audit)

    w = sub.add_parser("wan", help="emulate a slow, distant link in front of a coordinator")
    w.add_argument("--target", required=True, help="the coordinator's host:port")
    w.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (0: free)")
    w.add_argument("--bandwidth-mbit", type=float, required=True, help="per direction")
    w.add_argument("--latency-ms", type=float, default=0.0, help="one way")
    w.add_argument(
        "--loss-pct", type=float, default=0.0, help="random packet loss in percent (modelled)"
    )
    w.set_defaults(func=_cmd_wan)

    d = sub.add_parser("demo", help="coordinator + sites on localhost, digits, SQLite")
    d.add_argument("--state-dir", help="default: a temporary directory")
    d.add_argument("--out", help="write summary.json here")
    d.add_argument("--rounds", type=int, default=10, help="training rounds")
    d.add_argument("--sites", type=int, default=3, help="site processes")
    d.add_argument(
        "--strategy", default="fedavg",
        help="fedavg, fedavgm, fedadam, fedyogi, fedadagrad, diloco, fedprox or scaffold",
    )  # fmt: skip
    d.add_argument(
        "--alpha", type=float, default=0.5, help="label skew of the split (smaller: stronger)"
    )
    d.add_argument("--partition-seed", type=int, default=0, help="which split of that skew")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", help="evaluation reports")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    q = bsub.add_parser(
        "compare",
        help="centralised vs every-step sync vs DiLoCo over an emulated WAN: report and plots",
    )
    q.add_argument("--out", help="report.md, report.json and plots here (default compare-out)")
    q.add_argument("--steps", type=int, help="inner steps per site (default 512)")
    q.add_argument("--h", type=int, nargs="+", help="DiLoCo local steps per round (8 32 128)")
    q.add_argument(
        "--overlap-h", type=int, nargs="*",
        help="of those H, the ones also run with [train] overlap (default 32; none: no value)",
    )  # fmt: skip
    q.add_argument(
        "--only", nargs="+", metavar="NAME",
        help="run only these configurations (e.g. diloco-h32 diloco-h32-overlap); without "
        "centralised, time to target needs --target-loss",
    )  # fmt: skip
    q.add_argument("--sites", type=int, help="site processes (default 2)")
    q.add_argument("--bandwidth-mbit", type=float, help="each site's link (default 100)")
    q.add_argument("--latency-ms", type=float, help="one way (default 50)")
    q.add_argument("--target-loss", type=float, help="default: 1.1 x centralised final")
    q.add_argument(
        "--state-dir", help="keep the federation's state and logs here (default: a temp dir)"
    )
    q.add_argument(
        "--quick", action="store_true", help="a tiny set-up (tests): 16 steps, H 4 16, fast link"
    )
    q.add_argument(
        "--price-compute-hour", type=float, help="the cost line: per process-hour (default 1)"
    )
    q.add_argument("--price-gb", type=float, help="the cost line: per GB moved (default 0.09)")
    q.set_defaults(func=_cmd_bench_compare)
    return p


def _hint(args: argparse.Namespace, exc: grpc.RpcError) -> str:
    """What to try when a plaintext client meets a TLS daemon: gRPC only says the
    connection closed."""
    plaintext = getattr(args, "insecure", False)
    closed = "Socket closed" in (exc.details() or "")
    if plaintext and exc.code() == grpc.StatusCode.UNAVAILABLE and closed:
        return (
            " (a coordinator serving mutual TLS closes plaintext connections: give an admin "
            "--tls-dir instead of --insecure)"
        )
    return ""


# How gRPC says a connection was never made (as opposed to an answer of UNAVAILABLE).
_UNREACHABLE = ("failed to connect to all addresses", "errors resolving", "DNS resolution")


def _rpc_error(args: argparse.Namespace, exc: grpc.RpcError) -> str:
    details = exc.details() or ""
    if exc.code() == grpc.StatusCode.UNAVAILABLE and any(s in details for s in _UNREACHABLE):
        where = _address_and_source(args)
        if where:
            return f"cannot reach the coordinator at {where}: {details}{_hint(args, exc)}"
    return f"{exc.code().name}: {details}{_hint(args, exc)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # from the environment, argparse does not check it
        logformat.check_format(args.log_format)
    except ValueError as exc:
        parser.error(f"${logformat.ENV}: {exc}")
    logformat.setup(args.log_level, args.log_format)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `fedra run status --json | head` is fine
    lifetime.follow_lifeline()  # started by a LocalCluster: stop when its process ends
    try:
        return int(args.func(args))
    except (ConfigError, FileNotFoundError, PermissionError) as exc:  # e.g. a missing TLS file
        print(f"fedra: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"fedra: {_rpc_error(args, exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
