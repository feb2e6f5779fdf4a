"""Processes started on one machine end with the process that started them.

A ``LocalCluster`` (``fedra demo``, the tests, the benchmarks) hands each coordinator and
site a lifeline (``fedra.lifetime``): when the starter ends, however it ends, they stop.
The first tests hold the mechanism with a bare child process; the last kills a real
starter with SIGKILL, so that no ``stop`` runs, and waits for its coordinator, its
read replica and its site to go.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fedra.lifetime import LIFELINE_ENV, Lifeline, follow_lifeline

# A child that follows its lifeline; SIGTERM (its graceful stop) prints a line and exits
# 0 unless told to ignore it. It says "ready" once it follows the line.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading
    from fedra.lifetime import LIFELINE_ENV, follow_lifeline
    fd = os.environ.get(LIFELINE_ENV)
    ignore = sys.argv[1] == "ignore"
    def on_term(*_):
        print("SIGTERM", flush=True)
        if not ignore:
            sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("following" if follow_lifeline(grace_s=float(sys.argv[2])) else "not", flush=True)
    # Taken out for this process's own children, and not inherited by them:
    print(LIFELINE_ENV in os.environ, fd is not None and os.get_inheritable(int(fd)), flush=True)
    threading.Event().wait(120)
    print("never stopped", flush=True)
    """
)


def _child(
    lifeline: Lifeline | None, mode: str = "stop", grace_s: float = 60.0
) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop(LIFELINE_ENV, None)
    fds: tuple[int, ...] = ()
    if lifeline is not None:
        env.update(lifeline.env())
        fds = (lifeline.fd,)
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(grace_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        pass_fds=fds,
    )


def test_a_child_stops_gracefully_when_its_lifeline_is_cut() -> None:
    lifeline = Lifeline()
    child = _child(lifeline)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "following"
        assert child.stdout.readline().split() == ["False", "False"]
        assert child.poll() is None  # the line holds while its write end is open
        lifeline.cut()
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
        lifeline.cut()
    assert child.returncode == 0, err
    assert out.strip() == "SIGTERM"
    assert "the process that started this one is gone: stopping" in err


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    lifeline = Lifeline()
    child = _child(lifeline, mode="ignore", grace_s=3.0)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "following"
        assert child.stdout.readline().split() == ["False", "False"]
        lifeline.cut()
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
        lifeline.cut()
    assert child.returncode == -signal.SIGKILL
    assert out.strip() == "SIGTERM"  # asked first, killed only after the grace
    assert "still running 3 s after its starter went: killing it" in err


def test_without_a_lifeline_nothing_is_followed() -> None:
    child = _child(None)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "not"
    finally:
        child.kill()
        child.communicate(timeout=30)


def test_a_lifeline_variable_naming_no_pipe_is_not_followed() -> None:
    # E.g. a standard descriptor: its stdin here is /dev/null, which reads as at its end.
    env = {**os.environ, LIFELINE_ENV: "0"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "stop", "60"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "not"
        assert child.poll() is None  # not stopped
    finally:
        child.kill()
        _, err = child.communicate(timeout=30)
    assert "is not an open pipe" in err


@pytest.mark.parametrize("value", ["not-a-number", "987654"])
def test_a_bad_lifeline_variable_is_not_followed(value: str) -> None:
    environ = {LIFELINE_ENV: value}
    assert not follow_lifeline(environ)
    assert environ == {}


STARTER = textwrap.dedent(
    """
    import json, sys, threading
    from pathlib import Path
    from fedra.local import LocalCluster
    cluster = LocalCluster(Path(sys.argv[1]), secure=False)
    cluster.start_coordinator(timeout_s=120.0)
    cluster.start_site("site-a", ["fedra.examples.synthetic:task"], {"seed": 0, "samples": 16})
    cluster.wait_for_sites(["site-a"], timeout_s=120.0)
    print(json.dumps([cluster.coordinator.pid, cluster.sites["site-a"].pid]), flush=True)
    threading.Event().wait(300)
    """
)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_killed_starters_coordinator_and_sites_stop(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(LIFELINE_ENV, None)
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    pids: list[int] = []
    try:
        assert starter.stdout is not None
        line = starter.stdout.readline()
        assert line, starter.communicate(timeout=30)[1]
        pids = json.loads(line)
        replicas = _children(pids[0])  # the daemon's read replica (die_with_parent)
        assert not any(_gone(p) for p in pids + replicas)
        starter.kill()  # no clean-up of its own runs
        starter.communicate(timeout=30)
        deadline = time.monotonic() + 60.0
        while not all(_gone(p) for p in pids + replicas) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling processes' exit, with a deadline
        alive = [p for p in pids + replicas if not _gone(p)]
        assert not alive, f"still running 60 s after their starter was killed: {alive}"
    finally:
        starter.kill()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    logs = tmp_path / "logs"
    for name in ("coordinator.log", "site-a.log"):
        text = (logs / name).read_text()
        assert "the process that started this one is gone: stopping" in text, name
        assert "killing it" not in text, name  # SIGTERM stopped it: the graceful way


def _takes_sigterm(pid: int, tid: int) -> bool:
    """Whether thread ``tid`` of ``pid`` does not block SIGTERM (its SigBlk mask)."""
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return not (int(line.split()[1], 16) >> (signal.SIGTERM - 1)) & 1
    return False


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_the_daemon_stops_at_once_when_another_of_its_threads_takes_sigterm(
    tmp_path: Path,
) -> None:
    # A process-wide signal may land on any thread; its handler then runs in the main
    # thread only once that thread runs again, which a long wait would put off.
    import ctypes

    from fedra.local import LocalCluster

    with LocalCluster(tmp_path, secure=False) as cluster:
        cluster.start_coordinator(timeout_s=120.0)
        assert cluster.coordinator is not None
        pid = cluster.coordinator.pid
        others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
        tid = next(t for t in others if _takes_sigterm(pid, t))
        sent = time.monotonic()
        assert ctypes.CDLL(None, use_errno=True).tgkill(pid, tid, signal.SIGTERM) == 0
        assert cluster.coordinator.popen.wait(timeout=30) == 0
        took = time.monotonic() - sent
    assert took < 5.0, f"stopped {took:.1f} s after a thread of it took SIGTERM"
