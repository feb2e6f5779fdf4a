"""Coordinator scale benchmark: one daemon, N real site agents, every site in every round.

For each N it starts a coordinator as a real process (``LocalCluster``, plaintext on port 0,
otherwise its default flags) and N site agents: the real ``SiteAgent`` loop over the real
``Connection``, many agents per process as threads, in ``--procs`` worker processes (this
script again, with ``--worker``). Each site registers, polls, downloads, trains the
synthetic task (9 parameters) and uploads, in a run of ``--rounds`` rounds of FedAvg with
``sites_per_round = min_sites = N``. It prints, against each aim:

- the time until ListSites shows all N online, from the moment the agents start;
- rounds committed, and committed on their first attempt (each round's attempt number);
- round time, median and max (RoundStatus.duration_s of the committed rounds);
- coordinator CPU per site per round (/proc utime + stime from just before the run is
  submitted to when it is seen finished, round 0 included, over N x rounds);
- coordinator RSS and threads idle, with all sites connected, and at peak; RSS growth from
  idle to connected per connected site;
- the coordinator's seconds in garbage collections during the run (from its metrics,
  ``--http`` on a loopback port of its own), and their share of its CPU;
- latency p50/p99 of ListSites and GetRun, called ``--admin-hz`` times a second each by a
  thread of this process on its own channel while the rounds run (GetRun as `fedra run
  status` asks for it, a summary, or with ``--status-probe pages`` a page of rows);
- meanwhile, how late a process that only sleeps 5 ms at a time wakes (``WakeProbe``: a
  session of its own at this script's priority, as the operators' read process is): the
  machine's floor under those latencies;
- errors by gRPC status code: what each agent's ``Connection`` calls raised (counted by
  wrapping the methods of each agent's own Connection object), the agents' own warnings
  by message, and the admin caller's failed calls.

With ``--regions R`` (a list, e.g. ``0,2``: each N is measured with each), the sites
register with R regional coordinators (``fedra coordinator --upstream``, site i under
region i % R) and the run is submitted to their upstream, which samples the R regions
every round; it prints the upstream's CPU per region-round, the regions' per
site-round, and the sites each level projects to serve at one CPU-second per second.

Each agent's channel has a TCP connection of its own, as a site in a process of its own
has (``separate_connections``). Under each ``Connection`` is, by default, a ``grpc.aio``
channel on one event loop a worker, offered through the synchronous API
(``sync_over_aio.py``, ``--site-transport aio``): gRPC's synchronous client wakes every
200 ms for each call waiting, which at 5,000 sites was the workers' largest cost
(``--site-transport sync`` runs it). Training takes milliseconds, so a site heartbeats
only when its task outlasts the heartbeat interval; ``--fit-delay-s 6`` makes every one do so.

    OMP_NUM_THREADS=1 .venv/bin/python bench/scale_bench.py --sites 100,1000 --rounds 3 \\
        --procs 4 --out scale.json

Everything it starts is stopped, and its temporary directories removed, on any exit
(Ctrl-C and SIGTERM included); each N is bounded by ``--timeout-s``. One file on
purpose: the same script is the driver and each site-hosting worker, so the two never
disagree on what a worker is told or writes back.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import logging
import math
import os
import re
import selectors
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import grpc
import torch

from fedra.admin import AdminClient
from fedra.client.agent import SiteAgent
from fedra.client.config import SiteConfig
from fedra.client.connection import Connection
from fedra.client.task import Task, load_task
from fedra.local import ClusterError, LocalCluster, ManagedProcess
from fedra.protos.v1 import admin_pb2, admin_pb2_grpc
from fedra.runspec import RunSpec, TrainSpec

TASK = "fedra.examples.synthetic:task"  # nn.Linear(8, 1): 9 parameters
DONE = ("completed", "failed", "cancelled")
COUNTED_CALLS = ("register", "poll", "download", "upload", "report_failure")
ADMIN_CALL_TIMEOUT_S = 10.0
SLOWEST_KEPT = 5  # the slowest admin calls reported, each with when it was sent
SAMPLE_S = 0.25  # how often the coordinator's /proc figures are read
STOP_GRACE_S = 15.0  # for a worker to stop its agents and write its figures
READY_TIMEOUT_S = 60.0  # for the wake probe to start
WAKE_PROBE_S = 0.005  # the wake probe's sleep: it measures how late it wakes from each
# The aims: (key, text, the N it is stated for, or None for every N).
AIMS = (
    ("first_attempt", "every round commits on its first attempt", 5000),
    ("cpu", "coordinator CPU <= 2 ms per site per round", None),
    ("admin_p99", "admin p99 (ListSites, GetRun) <= 200 ms", 1000),
    ("rss", "coordinator RSS growth < 50 kB per connected site", None),
)
AIM_CPU_MS, AIM_ADMIN_P99_MS, AIM_RSS_KB = 2.0, 200.0, 50.0
AdminCall = Callable[[admin_pb2_grpc.AdminServiceStub, float], Any]  # (stub, timeout_s)


# -- the worker: many agents in one process ----------------------------------------------


class SiteTally:
    """What one worker's agents saw: each Connection call's outcome ("poll OK", "upload
    UNAVAILABLE"), their warnings by message template, agents that gave up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.warnings: Counter[str] = Counter()
        self.crashes: Counter[str] = Counter()
        self.frozen = False  # set when the bench stops the agents: what follows is ours
        self.heartbeat_longest_s = 0.0  # the longest heartbeat call, sent to answered
        self.heartbeat_gap_s = 0.0  # the longest between two of a task's heartbeats sent

    def add(self, counter: Counter[str], key: str) -> None:
        with self._lock:
            if not self.frozen:
                counter[key] += 1

    def longest(self, field: str, seconds: float) -> None:
        """Keep ``seconds`` in ``field`` if it is the longest yet (agents' threads call)."""
        with self._lock:
            if not self.frozen and seconds > getattr(self, field):
                setattr(self, field, seconds)

    def hook(self, conn: Connection) -> None:
        """Count every call an agent makes through ``conn`` (its instance's methods only)."""
        for name in COUNTED_CALLS:
            setattr(conn, name, self._counted(name, getattr(conn, name)))
        conn.heartbeat_future = self._beats(conn.heartbeat_future)  # type: ignore[method-assign]

    def _beats(self, send: Callable[..., Any]) -> Callable[..., Any]:
        """Heartbeats are sent without waiting for their answers: each is counted, and
        timed sent to answered, when its answer comes."""
        last: list[Any] = [None, 0.0]  # this agent's last heartbeat: its task, when sent

        @functools.wraps(send)
        def sent(task_id: str, *args: Any, **kwargs: Any) -> Any:
            at = time.monotonic()
            if last[0] == task_id:  # the same task's: how long since the last
                self.longest("heartbeat_gap_s", at - last[1])
            last[:] = [task_id, at]
            beat = send(task_id, *args, **kwargs)

            def answered(done: Any) -> None:
                if done.cancelled():  # unanswered when its task ended: not an outcome
                    return
                self.longest("heartbeat_longest_s", time.monotonic() - at)
                error = done.exception()
                code = _outcome(error) if isinstance(error, grpc.RpcError) else "OK"
                self.add(self.calls, f"heartbeat {code}")

            beat.add_done_callback(answered)
            return beat

        return sent

    def _counted(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:

        @functools.wraps(call)
        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                result = call(*args, **kwargs)
            except grpc.RpcError as exc:
                self.add(self.calls, f"{name} {_outcome(exc)}")
                raise
            except Exception as exc:  # e.g. a model whose SHA-256 does not match
                self.add(self.calls, f"{name} {type(exc).__name__}")
                raise
            # An update held as the site's next poll may bring its next task back with it.
            with_task = name == "upload" and getattr(result, "next_task", None) is not None
            self.add(self.calls, f"{name}+next-task OK" if with_task else f"{name} OK")
            return result

        return counted


def _outcome(error: grpc.RpcError) -> str:
    """A failed call's status code; a CANCELLED one with gRPC's words for who cancelled
    it (the server's core, the channel closing, the caller), which the code alone hides."""
    code = error.code()
    if code != grpc.StatusCode.CANCELLED:
        return code.name
    details = (error.details() or "").strip()
    return f"{code.name} ({details[:40]})" if details else code.name


class WarningCounter(logging.Handler):
    """Counts the agents' warnings and errors by message template (not by site)."""

    def __init__(self, tally: SiteTally) -> None:
        super().__init__(logging.WARNING)
        self.tally = tally

    def emit(self, record: logging.LogRecord) -> None:
        self.tally.add(self.tally.warnings, f"{record.levelname} {record.msg}"[:120])


def separate_connections(transport: str) -> None:
    """Give each channel of this process its own TCP connection, as a site in a process of
    its own has: gRPC otherwise shares one among channels with the same target and options,
    and an --insecure coordinator bounds calls per connection (--max-calls-per-admin).
    With ``transport`` "aio", each is a ``grpc.aio`` channel on one event loop of this
    process, offered through the synchronous API (``sync_over_aio``)."""
    import sync_over_aio  # noqa: PLC0415 - beside this script, on its path when it runs

    plain = grpc.insecure_channel
    loop = sync_over_aio.Loop() if transport == "aio" else None

    def insecure_channel(target: str, options: Any = None, compression: Any = None) -> grpc.Channel:
        own = [*(options or ()), ("grpc.use_local_subchannel_pool", 1)]
        if loop is not None:
            return sync_over_aio.Channel(loop, target, own)  # type: ignore[return-value]
        return plain(target, own, compression)

    grpc.insecure_channel = insecure_channel


def fewer_wakeups(seconds: float = 2.0) -> None:
    """gRPC's synchronous client wakes a thread waiting on a future or a stream 10 times a
    second to check for signals (``grpc._common.MAXIMUM_WAIT_TIMEOUT``); the workers look
    every ``seconds`` instead. A blocking unary call (a long poll, a heartbeat) is not one
    of those: its Cython loop wakes every 200 ms whatever this says (docs/scale.md, 5,000
    sites: what the emulation costs). The coordinator and the agents' code are unchanged."""
    grpc._common.MAXIMUM_WAIT_TIMEOUT = seconds  # type: ignore[attr-defined]


def plain_backoff(conn: Connection) -> None:
    """A site in backoff waits out its delay without watching its channel. The watch
    (``Connection.wait_reconnected``, to come back as soon as the coordinator answers) is
    a gRPC thread per channel that wakes five times a second (``_poll_connectivity``): one
    in a site process, but at 5,000 sites, thousands of them in backoff at once made a
    worker 1,900 threads and took the CPU that the coordinator needed."""

    def wait(timeout_s: float, stop: threading.Event) -> bool:
        stop.wait(timeout_s)
        return False

    conn.wait_reconnected = wait  # type: ignore[method-assign]


class GcPauses:
    """The worker's garbage collections: how many of the oldest generation, and the
    longest and total time the collector held the interpreter (every thread stops)."""

    def __init__(self) -> None:
        self.started, self.full, self.longest_s, self.total_s = 0.0, 0, 0.0, 0.0

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took = time.perf_counter() - self.started
        self.full += info.get("generation") == 2
        self.longest_s, self.total_s = max(self.longest_s, took), self.total_s + took


def take_turns(agent: SiteAgent, turns: threading.BoundedSemaphore) -> None:
    """The agent's work on a task (download, training, building its update) waits for one
    of its worker's ``turns``; its heartbeats, started before, do not. A site on a machine
    of its own answers its heartbeat whatever its training does. A worker's 1,250 sites
    whose round opens at one instant would instead all be runnable at once in one
    interpreter: each torch call or gRPC event hands the interpreter lock to the next of
    1,250 threads, a heartbeat waits its turn behind all of them, and at 5,000 sites
    thousands of sites went silent for 20 s with their updates still to come
    (docs/scale.md). With turns, a site waiting for one is a slow site that answers, as a
    real slow site is.

    The turn ends as an upload held as the next poll begins: once its update is accepted
    the call waits for the round (docs/rounds.md), and its thread sleeps on a future
    meanwhile."""
    work, upload = agent._train_and_upload, agent.conn.upload
    mine = [False]  # this agent holds a turn

    def give_back() -> None:
        if mine[0]:
            mine[0] = False
            turns.release()

    def in_turn(*args: Any, **kwargs: Any) -> None:
        turns.acquire()
        mine[0] = True
        try:
            work(*args, **kwargs)
        finally:
            give_back()

    def upload_after_turn(*args: Any, **kwargs: Any) -> Any:
        # then_poll_s, the eighth: a held upload (not _settle's header, nor a masked one)
        if kwargs.get("then_poll_s", args[7] if len(args) > 7 else 0.0) > 0:
            give_back()
        return upload(*args, **kwargs)

    agent._train_and_upload = in_turn  # type: ignore[method-assign]
    agent.conn.upload = upload_after_turn  # type: ignore[method-assign]


def lower_priority(nice: int) -> None:
    """Run this worker's threads at ``nice``, and its whole session too. Linux schedules a
    session (this worker has one of its own) as one group against the others
    (``/proc/sys/kernel/sched_autogroup_enabled``) and a thread's niceness counts only
    inside its group: four worker sessions at the default group niceness weigh four times
    the coordinator's, which then gets two fifths of a core while a round's opening
    makes the workers' threads runnable, whatever their own niceness."""
    nice = max(0, nice)
    os.nice(nice)
    with contextlib.suppress(OSError):  # no autogroups (or not Linux): the threads' nice
        Path("/proc/self/autogroup").write_text(f"{nice}\n")


def site_id(index: int) -> str:
    return f"scale-{index:05d}"


def make_agent(
    address: str, index: int, tasks: dict[str, Task], tally: SiteTally, fit_delay_s: float
) -> SiteAgent:
    """A site as a site.toml with defaults would make it: plaintext, no state directory."""
    data = {"samples": 32, "seed": index, "shift": 0.5 * (index % 100) / 100}
    config = SiteConfig(
        site_id=site_id(index),
        coordinator=address,
        allowed_tasks=(TASK,),
        data={**data, "fit_delay_s": fit_delay_s},
        threads=1,
        insecure=True,
    )
    agent = SiteAgent(config, tasks=tasks)
    tally.hook(agent.conn)
    plain_backoff(agent.conn)
    return agent


def serve(agent: SiteAgent, tally: SiteTally) -> None:
    try:
        agent.run()
    except Exception as exc:  # a site process would exit here; counted, the others go on
        code = f" {exc.code().name}" if isinstance(exc, grpc.RpcError) else ""
        tally.add(tally.crashes, f"{type(exc).__name__}{code}")


def cpu_list(text: str) -> set[int]:
    """CPUs from a list such as '1' or '0,2-3'; ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or int(last or first) < int(first):
            raise ValueError(f"--site-cpus: not a CPU list: {text!r}")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def worker_main(args: argparse.Namespace) -> None:
    """Build the agents, say "ready", start them on "go", stop them on "stop" (or when
    stdin closes, or at the deadline), then write the tally to ``--stats``."""
    if args.site_cpus:  # first: inherited by every thread started from here on
        os.sched_setaffinity(0, cpu_list(args.site_cpus))
    torch.set_num_threads(1)
    lower_priority(args.site_nice)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    separate_connections(args.site_transport)
    fewer_wakeups()
    tally = SiteTally()
    logging.getLogger("fedra.site").addHandler(WarningCounter(tally))
    tasks = {TASK: load_task(TASK)}
    indices = range(args.first, args.first + args.count)
    # With regions, site i registers with region i % R (the addresses in order).
    addresses = args.address.split(",")
    agents = [
        make_agent(addresses[i % len(addresses)], i, tasks, tally, args.fit_delay_s)
        for i in indices
    ]
    if args.site_turns > 0:  # 0 by default with --fit-delay-s, whose sleep would hold a turn
        turns = threading.BoundedSemaphore(args.site_turns)
        for agent in agents:
            take_turns(agent, turns)
    # No automatic collections in a worker: a site process of its own has a small heap
    # and its collections take milliseconds, but a worker holds 1,250 sites' objects and
    # every collection stops all of them at once, heartbeats included. At 5,000 sites
    # the workers' collections took 217 of their 234 s of CPU, the longest 17.8 s, and
    # thousands of sites went silent for 20 s in each round's first attempt. What is
    # built is frozen out of the way; what a run leaves in cycles waits for the end.
    if args.worker_gc == "off":
        gc.collect()
        gc.freeze()
        gc.disable()
    pauses = GcPauses()
    gc.callbacks.append(pauses.callback)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    threads = [
        threading.Thread(target=serve, args=(a, tally), name=a.config.site_id, daemon=True)
        for a in agents
    ]
    for thread in threads:
        thread.start()
    stop = threading.Event()

    def wait_for_stop() -> None:  # "stop", or stdin closed: the bench is gone
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait_for_stop, daemon=True).start()
    stop.wait(args.timeout_s)
    finish(agents, threads, tally, args.stats, pauses)


def finish(
    agents: list[SiteAgent],
    threads: list[threading.Thread],
    tally: SiteTally,
    path: Path,
    pauses: GcPauses,
) -> NoReturn:
    """Stop the agents (what they see from here on is not counted), write the tally."""
    tally.frozen = True
    for agent in agents:
        agent.shutdown()
    end = time.monotonic() + STOP_GRACE_S / 2
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    stats = {
        "calls": dict(tally.calls),
        "warnings": dict(tally.warnings),
        "crashes": dict(tally.crashes),
        "rounds_done": sum(a.rounds_done for a in agents),
        "registered": sum(a.registered for a in agents),
        "agents_not_stopped": sum(t.is_alive() for t in threads),
        "gc": {"full": pauses.full, "longest_s": pauses.longest_s, "total_s": pauses.total_s},
        "heartbeat_longest_s": tally.heartbeat_longest_s,
        "heartbeat_gap_s": tally.heartbeat_gap_s,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stats))
    tmp.replace(path)
    # Agent threads still in a call could hold interpreter exit: the figures are written.
    os._exit(0)


# -- the driver ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcSample:
    """A process's CPU seconds so far, resident memory and thread count."""

    cpu_s: float
    rss_kb: int
    threads: int


def proc_sample(pid: int) -> ProcSample:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return ProcSample(cpu_s, int(fields["VmRSS"].split()[0]), int(fields["Threads"]))


@dataclass
class Worker:
    popen: subprocess.Popen[bytes]
    stats_path: Path  # where it writes its SiteTally when it stops


def start_workers(
    addresses: list[str], n: int, args: argparse.Namespace, root: Path, timeout_s: float
) -> list[Worker]:
    """``procs`` worker processes sharing the N sites; each told its share, and the
    coordinators its sites register with (site i with ``addresses[i % len]``)."""
    address = ",".join(addresses)
    workers, first, procs = [], 0, max(1, min(args.procs, n))
    for i in range(procs):
        count = n // procs + (i < n % procs)
        stats = root / f"worker-{i}.json"
        command = [sys.executable, __file__, "--worker", "--address", address]
        command += ["--first", str(first), "--count", str(count), "--stats", str(stats)]
        command += ["--timeout-s", f"{timeout_s:.0f}", "--fit-delay-s", str(args.fit_delay_s)]
        command += ["--site-nice", str(args.site_nice), "--site-cpus", args.site_cpus]
        command += ["--site-turns", str(args.site_turns), "--worker-gc", args.worker_gc]
        command += ["--site-transport", args.site_transport]
        with (root / f"worker-{i}.log").open("ab") as log:
            popen = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                start_new_session=True,  # a Ctrl-C reaches this process, which stops them
            )
        workers.append(Worker(popen, stats))
        first += count
    return workers


def wait_ready(workers: list[Worker], deadline: float) -> None:
    """Wait for every worker's "ready" line (its agents built, nothing dialled yet)."""
    with selectors.DefaultSelector() as selector:
        for w in workers:
            assert w.popen.stdout is not None
            selector.register(w.popen.stdout, selectors.EVENT_READ, w)
        waiting = len(workers)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{waiting} worker processes not ready in time")
            for key, _ in selector.select(left):
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if line.strip() != b"ready":
                    raise ClusterError(f"a worker process exited (rc {key.data.popen.poll()})")
                selector.unregister(key.fileobj)
                waiting -= 1


def tell(workers: list[Worker], word: str) -> None:
    for w in workers:
        if w.popen.stdin is not None and w.popen.poll() is None:
            try:
                w.popen.stdin.write(word.encode() + b"\n")
                w.popen.stdin.flush()
            except BrokenPipeError:
                pass


def stop_workers(workers: list[Worker]) -> list[dict[str, Any]]:
    """Tell every worker to stop, give them STOP_GRACE_S, kill the rest; their tallies."""
    tell(workers, "stop")
    end = time.monotonic() + STOP_GRACE_S
    for w in workers:
        try:
            w.popen.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.popen.kill()
            w.popen.wait()
        for stream in (w.popen.stdin, w.popen.stdout):
            if stream is not None:
                stream.close()
    found = []
    for w in workers:
        try:
            found.append(json.loads(w.stats_path.read_text()))
        except (OSError, ValueError):
            found.append({"missing": True})
    return found


class Sampler(threading.Thread):
    """The coordinator's CPU, RSS and threads every SAMPLE_S, each with its wall-clock time
    (the coordinator's round ledger is in the same clock)."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="proc-sampler", daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, ProcSample]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            try:
                self.samples.append((time.time(), proc_sample(self.pid)))
            except (OSError, KeyError):  # the coordinator is gone: the run's wait says so
                return

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def at(self, unix_s: float) -> ProcSample | None:
        """The first sample taken at or after ``unix_s``; else the last one."""
        after = [sample for t, sample in self.samples if t >= unix_s]
        return after[0] if after else (self.samples[-1][1] if self.samples else None)

    def peak(self) -> ProcSample:
        """The most RSS and threads seen (and the CPU seconds of the last sample)."""
        taken = [sample for _, sample in self.samples] or [ProcSample(0.0, 0, 0)]
        rss, threads = max(x.rss_kb for x in taken), max(x.threads for x in taken)
        return ProcSample(taken[-1].cpu_s, rss, threads)


class AdminProbe(threading.Thread):
    """One admin call ``hz`` times a second on a channel of its own, timed and its
    failures counted by status code; the last answer kept."""

    def __init__(self, address: str, name: str, call: AdminCall, hz: float) -> None:
        super().__init__(name=f"probe-{name}", daemon=True)
        self.address, self.call_name, self.call, self.period_s = address, name, call, 1.0 / hz
        self.latency_ms: list[float] = []
        self.sent_at: list[float] = []  # when each timed call was sent (unix s)
        self.errors: Counter[str] = Counter()
        self.last: Any = None
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(ADMIN_CALL_TIMEOUT_S * 2)

    def run(self) -> None:
        with AdminClient(self.address) as admin:
            next_at = time.monotonic()
            while not self._halt.is_set():
                started, sent = time.perf_counter(), time.time()
                try:
                    self.last = self.call(admin.stub, ADMIN_CALL_TIMEOUT_S)
                    self.latency_ms.append((time.perf_counter() - started) * 1000)
                    self.sent_at.append(sent)
                except grpc.RpcError as exc:
                    self.errors[f"{self.call_name} {exc.code().name}"] += 1
                next_at = max(next_at + self.period_s, time.monotonic() - self.period_s)
                self._halt.wait(max(0.0, next_at - time.monotonic()))

    def figures(self) -> dict[str, Any]:
        values = self.latency_ms
        slowest = sorted(zip(values, self.sent_at, strict=True), reverse=True)[:SLOWEST_KEPT]
        return {
            "calls": len(values),
            "p50_ms": percentile(values, 0.5),
            "p99_ms": percentile(values, 0.99),
            "slowest": [{"ms": ms, "sent_unix_s": at} for ms, at in slowest],
        }


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1), None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def wake_probe_main() -> None:
    """The wake probe's process: sleep ``WAKE_PROBE_S`` again and again until stdin closes
    (or says anything), then print how late each wake-up was, as JSON. It does no work,
    so its lateness is the machine's alone: how long a process at the coordinator's
    priority, in a session of its own as the operators' read process is, waited for a
    CPU while the run went on."""
    late_ms: list[float] = []
    print("ready", flush=True)
    with selectors.DefaultSelector() as selector:
        selector.register(sys.stdin, selectors.EVENT_READ)
        while True:
            began = time.monotonic()
            if selector.select(WAKE_PROBE_S):
                break
            late_ms.append(max(0.0, (time.monotonic() - began - WAKE_PROBE_S) * 1000))
    print(json.dumps(wake_figures(late_ms)))


def wake_figures(late_ms: list[float]) -> dict[str, Any]:
    return {
        "wakes": len(late_ms),
        "p50_ms": percentile(late_ms, 0.5),
        "p99_ms": percentile(late_ms, 0.99),
        "max_ms": max(late_ms, default=None),
        "over_50_ms": sum(x > 50 for x in late_ms),
    }


class WakeProbe(AbstractContextManager["WakeProbe"]):
    """The wake probe (``--wake-probe``) as a process of its own in a session of its own,
    at this process's priority, for as long as the ``with`` block: what an idle process
    on this machine waits to be run is the floor under every admin call's latency."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self._popen = subprocess.Popen(
            [sys.executable, __file__, "--wake-probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )

    def __enter__(self) -> WakeProbe:
        """Once the probe is ready (it imports what this script does)."""
        assert self._popen.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._popen.stdout, selectors.EVENT_READ)
            if not selector.select(READY_TIMEOUT_S) or self._popen.stdout.readline() != b"ready\n":
                self.__exit__()
                raise ClusterError("the wake probe did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            out, _ = self._popen.communicate(b"stop\n", timeout=STOP_GRACE_S)
            self.figures = {**json.loads(out), "pid": self._popen.pid}
        except (subprocess.TimeoutExpired, ValueError):
            self._popen.kill()
            self._popen.wait()


def make_spec(n: int, rounds: int, deadline_s: float) -> RunSpec:
    return RunSpec(
        task=TASK,
        rounds=rounds,
        name=f"scale-n{n}",
        sites_per_round=n,
        min_sites=n,
        round_deadline_s=deadline_s,
        join_timeout_s=deadline_s,
        seed=0,
        train=TrainSpec(local_steps=1, batch_size=16, learning_rate=0.05),
    ).validate()


def wait_online(cluster: LocalCluster, n: int, deadline: float) -> tuple[float | None, int]:
    """Seconds until ListSites shows ``n`` sites online (None: not by the deadline), and
    how many it showed last."""
    started, online = time.monotonic(), 0
    assert cluster.coordinator is not None
    with cluster.admin() as admin:
        while time.monotonic() < deadline:
            if not cluster.coordinator.alive():
                raise ClusterError(f"the coordinator exited:\n{cluster.coordinator.log_tail()}")
            # A slow ListSites is tried again: the admin probe's figures are the ones that count.
            with contextlib.suppress(grpc.RpcError):
                online = sum(s.online for s in admin.sites())
            if online >= n:
                return time.monotonic() - started, online
            time.sleep(0.2)  # polling a readiness condition, with a deadline
    return None, online


def round_figures(status: admin_pb2.RunStatus) -> dict[str, Any]:
    """Rounds 1.. as committed (or not), each with its attempt number and duration."""
    rounds: list[dict[str, Any]] = [
        {
            "number": r.number,
            "attempt": r.attempt,
            "status": r.status,
            "updates": r.updates,
            "duration_s": r.duration_s,
            "opened_unix_s": r.opened_unix_s,
            "closed_unix_s": r.closed_unix_s,
            "stages": dict(r.stages),
        }
        for r in status.rounds
    ]
    training = [r for r in rounds if r["number"] >= 1]
    committed = [r for r in training if r["status"] == "committed"]
    durations = [float(r["duration_s"]) for r in committed]
    problems: Counter[str] = Counter(
        f"{p.status}: {p.error}"[:120]
        for r in status.rounds
        for p in r.participations
        if p.status != "accepted"
    )
    ordered = sorted(rounds, key=lambda r: r["number"])
    gaps = [b["opened_unix_s"] - a["closed_unix_s"] for a, b in itertools.pairwise(ordered)]
    closes = [r["closed_unix_s"] for r in rounds if r["closed_unix_s"]]
    return {
        "state": status.state,
        "reason": status.reason,
        "run_s": max(closes) - ordered[0]["opened_unix_s"] if closes else None,
        "between_rounds_s": gaps,
        "committed": len(committed),
        "first_attempt": sum(r["attempt"] == 1 for r in committed),
        "round_s_median": statistics.median(durations) if durations else None,
        "round_s_max": max(durations) if durations else None,
        "participation_problems": dict(problems),
        "rounds": rounds,
    }


def wait_finished(probe: AdminProbe, coordinator: ManagedProcess, deadline: float) -> bool:
    """Whether the GetRun probe saw the run end before the deadline (or the coordinator
    exit)."""
    while time.monotonic() < deadline and coordinator.alive():
        if probe.last is not None and probe.last.state in DONE:
            return True
        time.sleep(SAMPLE_S)  # polling what the probe last saw, with a deadline
    return False


def probe_admin(
    cluster: LocalCluster, run_id: str, hz: float, deadline: float, status: str = "summary"
) -> tuple[bool, dict[str, Any]]:
    """ListSites and GetRun, each on a thread of its own, until the run ends: whether it
    ended in time, and the calls' figures. ``status``: GetRun as `fedra run status` asks
    (``summary``: counts, paged) or for every row (``pages``: its first page, about 1 MiB)."""
    assert cluster.coordinator is not None
    get_run = admin_pb2.GetRunRequest(run_id=run_id, page=True, summary=status == "summary")
    calls: dict[str, AdminCall] = {
        "ListSites": lambda stub, t: stub.ListSites(admin_pb2.ListSitesRequest(), timeout=t),
        "GetRun": lambda stub, t: stub.GetRun(get_run, timeout=t),
    }
    # The admin port where the daemon has one (its operators' read process), as an
    # operator's CLI uses it; else the site port (--coordinator-flags '--admin-port none').
    address = cluster.admin_address or cluster.address
    probes = {name: AdminProbe(address, name, call, hz) for name, call in calls.items()}
    with WakeProbe() as wake:
        for probe in probes.values():
            probe.start()
        try:
            finished = wait_finished(probes["GetRun"], cluster.coordinator, deadline)
        finally:
            for probe in probes.values():
                probe.stop()
    errors: Counter[str] = Counter()
    for probe in probes.values():
        errors.update(probe.errors)
    figures = {"admin": {name: p.figures() for name, p in probes.items()}, "wake": wake.figures}
    return finished, {**figures, "admin_errors": dict(errors), "status_probe": status}


def read_rounds(cluster: LocalCluster, run_id: str) -> dict[str, Any]:
    """The run's rounds as the coordinator recorded them (read once its sites stopped)."""
    try:
        with cluster.admin() as admin:
            return round_figures(admin.status(run_id))
    except grpc.RpcError as exc:
        figures: dict[str, Any] = {"state": f"unknown (GetRun {exc.code().name})"}
        figures.update(committed=0, first_attempt=0, participation_problems={}, rounds=[])
        return figures


def merge_tallies(stats: list[dict[str, Any]]) -> dict[str, Any]:
    calls: Counter[str] = Counter()
    warnings: Counter[str] = Counter()
    crashes: Counter[str] = Counter()
    for s in stats:
        calls.update(s.get("calls", {}))
        warnings.update(s.get("warnings", {}))
        crashes.update(s.get("crashes", {}))
    errors: Counter[str] = Counter()
    for key, count in calls.items():
        code = key.split()[1]
        if code != "OK":
            errors[code] += count
    return {
        "errors_by_code": dict(errors),
        "calls": dict(sorted(calls.items())),
        "warnings": dict(warnings),
        "agents_crashed": dict(crashes),
        "rounds_done": sum(s.get("rounds_done", 0) for s in stats),
        "registered": sum(s.get("registered", 0) for s in stats),
        "agents_not_stopped": sum(s.get("agents_not_stopped", 0) for s in stats),
        "workers_missing_figures": sum(bool(s.get("missing")) for s in stats),
        "gc_longest_s": max((s.get("gc", {}).get("longest_s", 0.0) for s in stats), default=0.0),
        "gc_total_s": sum(s.get("gc", {}).get("total_s", 0.0) for s in stats),
        "gc_full": sum(s.get("gc", {}).get("full", 0) for s in stats),
        "heartbeat_longest_s": [s.get("heartbeat_longest_s", 0.0) for s in stats],
        "heartbeat_gap_s": [s.get("heartbeat_gap_s", 0.0) for s in stats],
    }


def database(db: str) -> AbstractContextManager[str | None]:
    """None (SQLite in the state directory), or a fresh PostgreSQL database under ``db``."""
    from chaos import database as fresh  # noqa: PLC0415 - imports PostgreSQL's driver

    return fresh(None if db == "sqlite" else db, prefix="scale")


class Measurement:
    """One N's figures as they come in, and when each stage of it ended."""

    def __init__(self, n: int, regions: int, args: argparse.Namespace) -> None:
        self.n, self.regions, self.args = n, regions, args
        self.started = time.monotonic()
        self.deadline = self.started + args.timeout_s
        procs = max(1, min(args.procs, n))
        self.result: dict[str, Any] = {"sites": n, "procs": procs, "rounds_requested": args.rounds}
        self.result["regions"] = regions  # 0: flat
        self.region_clusters: list[LocalCluster] = []
        self.result["timeline_s"] = {}  # seconds from the start of this N

    def reached(self, stage: str) -> None:
        self.result["timeline_s"][stage] = round(time.monotonic() - self.started, 2)

    def connect(
        self, cluster: LocalCluster, sites_at: list[LocalCluster], root: Path, workers: list[Worker]
    ) -> None:
        """Start the worker processes (into ``workers``), and their agents once all are
        built; wait until every site is online at the coordinator it registers with
        (``sites_at``: ``cluster`` itself, or its regions). RSS and registration figures
        are the first of those coordinators', per site it holds."""
        assert cluster.coordinator is not None and sites_at[0].coordinator is not None
        r, n, pid = self.result, self.n, sites_at[0].coordinator.pid
        r["idle"] = asdict(idle := proc_sample(pid))
        left = self.deadline - time.monotonic()
        addresses = [c.address for c in sites_at]
        workers += start_workers(addresses, n, self.args, root, left + 60.0)
        mine = [c.coordinator.pid for c in (cluster, *self.region_clusters) if c.coordinator]
        r["pids"] = [*mine, *(w.popen.pid for w in workers)]
        wait_ready(workers, self.deadline)
        self.reached("agents_built")
        tell(workers, "go")
        began, seen = time.monotonic(), 0
        for k, at in enumerate(sites_at):  # site i registers with sites_at[i % len]
            held = len(range(k, n, len(sites_at)))
            waited, online = wait_online(at, held, self.deadline)
            seen += online
            if waited is None:
                r["register_s"], r["online_seen"] = None, seen
                raise TimeoutError(f"only {seen} of {n} sites online in time")
        r["register_s"], r["online_seen"] = time.monotonic() - began, seen
        self.reached("all_online")
        held = len(range(0, n, len(sites_at)))
        r["connected"] = asdict(connected := proc_sample(pid))
        r["rss_growth_kb_per_site"] = (connected.rss_kb - idle.rss_kb) / held
        r["register_cpu_ms_per_site"] = 1000 * (connected.cpu_s - idle.cpu_s) / held

    def run(self, cluster: LocalCluster, workers: list[Worker]) -> None:
        """The run over all sites (or all regions), probed until it ends; then the sites
        stop (emptying ``workers``), their figures are in, and the rounds are read,
        faster without them."""
        assert cluster.coordinator is not None
        sampler = Sampler(cluster.coordinator.pid)
        sampler.start()
        reads_pid = _reads_pid(cluster)
        reads_before = proc_sample(reads_pid) if reads_pid else None
        region_pids = [c.coordinator.pid for c in self.region_clusters if c.coordinator]
        try:
            gc_before = gc_seconds(cluster.state_dir)
            before = proc_sample(cluster.coordinator.pid)
            regions_before = sum(proc_sample(pid).cpu_s for pid in region_pids)
            sites_before = sum(proc_sample(w.popen.pid).cpu_s for w in workers)
            with cluster.admin() as admin:
                sampled = self.regions or self.n  # the upstream's sites are the regions
                spec = make_spec(sampled, self.args.rounds, self.args.round_deadline_s)
                submitted = time.time()
                run_id = admin.submit(spec)
                submit_s = time.time() - submitted
            finished, self.result["run"] = probe_admin(
                cluster, run_id, self.args.admin_hz, self.deadline, self.args.status_probe
            )
            self.reached("run_ended")
            gc_after = gc_seconds(cluster.state_dir)
            if gc_before is not None and gc_after is not None:
                by_generation = {g: gc_after[g] - gc_before.get(g, 0.0) for g in gc_after}
                self.result["coordinator_gc_s"] = sum(by_generation.values())
                self.result["coordinator_gc_s_by_generation"] = by_generation
            # The emulated sites' own CPU in the run: what the machine had left for the
            # coordinator is what they did not take.
            sites_cpu_s = sum(proc_sample(w.popen.pid).cpu_s for w in workers) - sites_before
            if region_pids:
                self.result["regions_cpu_s"] = (
                    sum(proc_sample(pid).cpu_s for pid in region_pids) - regions_before
                )
            self.result["sites_cpu_s"] = sites_cpu_s
            self.result["site_calls"] = merge_tallies(stop_workers(workers))
            workers.clear()
            self.reached("sites_stopped")
        finally:
            sampler.stop()
        run = self.result["run"]
        run.update(read_rounds(cluster, run_id), finished_in_time=finished, submit_s=submit_s)
        opened = [r["opened_unix_s"] for r in run["rounds"]]
        run["submit_to_round_0_s"] = min(opened) - submitted if opened else None
        # The sites' CPU over the whole run, per site and training attempt opened (a failed
        # attempt asked every site too): round 0, one site's, is in the run but not counted.
        attempts = sum(x["attempt"] for x in run["rounds"] if x["number"] > 0)
        if attempts and "sites_cpu_s" in self.result:
            per = 1000 * self.result["sites_cpu_s"] / (self.n * attempts)
            self.result["sites_cpu_ms_per_site_attempt"] = per
        self.reached("rounds_read")
        self._cpu(before, sampler)
        if (
            reads_before is not None and reads_pid is not None
        ):  # the operators' reads, in their own process
            run["reads_process_cpu_s"] = proc_sample(reads_pid).cpu_s - reads_before.cpu_s
        run["admin_port"] = bool(cluster.admin_address)
        if not finished:
            late = f"the run did not end within --timeout-s {self.args.timeout_s:g}"
            gone = "the coordinator exited during the run"
            self.result["failure"] = late if cluster.coordinator.alive() else gone

    def _cpu(self, before: ProcSample, sampler: Sampler) -> None:
        """CPU from just before the run was submitted to its last commit."""
        run = self.result["run"]
        # Per training round committed (round 0, the initial model, is one site's): with
        # none committed there is no figure, not a small one.
        closed = [
            r["closed_unix_s"]
            for r in run["rounds"]
            if r["status"] == "committed" and r["number"] > 0
        ]
        after = sampler.at(max(closed)) if closed else None
        cpu_s = None if after is None else after.cpu_s - before.cpu_s
        run["coordinator_cpu_s"] = cpu_s
        sampled = self.regions or self.n  # two levels: the upstream's, a region-round
        per = None if cpu_s is None else 1000 * cpu_s / (sampled * len(closed))
        run["cpu_ms_per_site_round"] = per
        run["peak"] = asdict(sampler.peak())
        regions_cpu_s = self.result.get("regions_cpu_s")
        if self.regions and closed and regions_cpu_s is not None:
            # The regions' CPU over the whole run, per site-round of the rounds committed
            # (a regional run a round, and the region's own upload, included).
            run["regions_cpu_ms_per_site_round"] = 1000 * regions_cpu_s / (self.n * len(closed))
        # Site-rounds one CPU-second serves: sites a coordinator holds at one CPU-second
        # per second of round; two levels: regions an upstream holds times sites a region.
        if per:
            run["projected_sites"] = 1000 / per
            region_ms = run.get("regions_cpu_ms_per_site_round")
            if self.regions:
                run["projected_sites"] = (1000 / per) * (1000 / region_ms) if region_ms else None


def _reads_pid(cluster: LocalCluster) -> int | None:
    """The pid of the daemon's operators' read process, if it has one."""
    try:
        ready = json.loads((cluster.state_dir / "reads" / "ready.json").read_text())
    except (OSError, ValueError):
        return None
    return int(ready["pid"]) if cluster.admin_address else None


def measure(n: int, regions: int, args: argparse.Namespace) -> dict[str, Any]:
    """One coordinator and ``n`` sites (or an upstream, ``regions`` regional coordinators
    and ``n`` sites spread over them), everything stopped and removed before it returns."""
    m = Measurement(n, regions, args)
    with ExitStack() as stack:
        name = f"n{n}" if not regions else f"n{n}-r{regions}"
        root = args.work_dir / name if args.work_dir else None
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedra-scale-")))
        root.mkdir(parents=True, exist_ok=True)
        db_url = stack.enter_context(database(args.db))
        cluster = stack.enter_context(LocalCluster(root / "coordinator", secure=False))
        workers: list[Worker] = []
        try:
            # Metrics on a port of its own (its collector's seconds: ``gc_seconds``).
            flags = ["--http", "127.0.0.1:0", *shlex.split(args.coordinator_flags)]
            cluster.start_coordinator(db_url=db_url, timeout_s=120.0, flags=flags)
            m.reached("coordinator_ready")
            m.region_clusters = start_regions(stack, cluster, regions, root, args, m.deadline)
            if regions:
                m.reached("regions_ready")
            m.connect(cluster, m.region_clusters or [cluster], root, workers)
            m.run(cluster, workers)
        except (ClusterError, TimeoutError, OSError, grpc.RpcError) as exc:
            m.result["failure"] = f"{type(exc).__name__}: {exc}"
            if cluster.coordinator is not None:
                m.result["coordinator_log_tail"] = cluster.coordinator.log_tail(15)
        finally:
            if workers or "site_calls" not in m.result:
                m.result["site_calls"] = merge_tallies(stop_workers(workers))
            if cluster.coordinator is not None:
                m.result["coordinator_late"] = lateness(cluster.coordinator.log_path)
    m.result["aims"] = judge(m.result)
    return m.result


_GC_SECONDS = re.compile(r'^fedra_gc_seconds_total\{generation="([0-9])"\} ([0-9.e+-]+)$', re.M)


def gc_seconds(state_dir: Path) -> dict[int, float] | None:
    """The coordinator's seconds in garbage collections so far, by generation, from its
    metrics (``--http``, named in ``coordinator.json``); None if it serves none."""
    try:
        address = json.loads((state_dir / "coordinator.json").read_text())["http_address"]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
            text = reply.read().decode()
    except (OSError, KeyError, ValueError):
        return None
    found = _GC_SECONDS.findall(text)
    return {int(g): float(x) for g, x in found} if found else None


_LAG_LOGGED = re.compile(r"hears its sites ([0-9.]+) s late")
_STALL_LOGGED = re.compile(r"event loop ran ([0-9.]+) s late")


def lateness(log_path: Path) -> dict[str, Any]:
    """What the coordinator logged of hearing late: the largest lag of its sites' calls in
    gRPC's queue and the longest stall of its loop (each logged at most every 10 s, from
    1 s on), and how often it logged each."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return {}
    lags = [float(x) for x in _LAG_LOGGED.findall(text)]
    stalls = [float(x) for x in _STALL_LOGGED.findall(text)]
    return {
        "lag_logged": len(lags),
        "lag_max_s": max(lags, default=0.0),
        "stall_logged": len(stalls),
        "stall_max_s": max(stalls, default=0.0),
    }


def start_regions(
    stack: ExitStack,
    upstream: LocalCluster,
    count: int,
    root: Path,
    args: argparse.Namespace,
    deadline: float,
) -> list[LocalCluster]:
    """``count`` regional coordinators of ``upstream`` (``--upstream``, plaintext both
    ways, each its own SQLite), once the upstream sees every one online."""
    regions = []
    for k in range(count):
        region = stack.enter_context(LocalCluster(root / f"region-{k}", secure=False))
        flags = ["--upstream", upstream.address, "--upstream-insecure"]
        flags += ["--region-id", f"region-{k}", "--region-task", TASK]
        flags += shlex.split(args.coordinator_flags)
        left = max(1.0, min(120.0, deadline - time.monotonic()))
        region.start_coordinator(timeout_s=left, flags=flags)
        regions.append(region)
    if count:
        waited, online = wait_online(upstream, count, deadline)
        if waited is None:
            raise TimeoutError(f"only {online} of {count} regions online upstream in time")
    return regions


def judge(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each aim with the figure it is judged on and whether it is met at this N."""
    run = r.get("run", {})
    admin = run.get("admin", {})
    p99s = [a["p99_ms"] for a in admin.values() if a["p99_ms"] is not None]
    values: dict[str, Any] = {
        "first_attempt": run.get("first_attempt"),
        # Two levels: what a site costs the coordinator it talks to, its region.
        "cpu": run.get(
            "regions_cpu_ms_per_site_round" if r.get("regions") else "cpu_ms_per_site_round"
        )
        if run.get("finished_in_time")
        else None,
        "admin_p99": max(p99s) if p99s else None,
        "rss": r.get("rss_growth_kb_per_site") if r.get("register_s") is not None else None,
    }
    met = {
        "first_attempt": values["first_attempt"] == r["rounds_requested"],
        "cpu": values["cpu"] is not None and values["cpu"] <= AIM_CPU_MS,
        "admin_p99": values["admin_p99"] is not None and values["admin_p99"] <= AIM_ADMIN_P99_MS,
        "rss": values["rss"] is not None and values["rss"] < AIM_RSS_KB,
    }
    return [
        {"aim": key, "text": text, "stated_for_sites": at, "value": values[key], "met": met[key]}
        for key, text, at in AIMS
    ]


def _ms(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f} ms"


def _when(slowest: list[dict[str, float]], opened: list[tuple[float, int]]) -> str:
    """'MS ms N s into round R' for each of the slowest calls: whether they gather at a
    round's opening (the burst of a thousand polls answered, then their uploads)."""
    parts = []
    for call in slowest:
        before = [(t, n) for t, n in opened if t <= call["sent_unix_s"]]
        where = "before round 0"
        if before:
            where = f"{call['sent_unix_s'] - before[-1][0]:.1f} s into round {before[-1][1]}"
        parts.append(f"{call['ms']:.0f} ms {where}")
    return ", ".join(parts) or "-"


def _kb(sample: dict[str, Any] | None) -> str:
    return "-" if sample is None else f"{sample['rss_kb'] / 1024:.0f} MB, {sample['threads']} thr"


def print_result(r: dict[str, Any]) -> None:
    n, run, sites = r["sites"], r.get("run", {}), r["site_calls"]
    where = f", in {r['regions']} regions under one upstream" if r.get("regions") else ""
    print(f"\nN={n}{where} ({r['procs']} worker processes, {r['rounds_requested']} rounds):")
    reg = r.get("register_s")
    shown = f"{reg:.1f} s" if reg is not None else f"NOT all: {r.get('online_seen')} online"
    print(f"  register: all {n} online in {shown}", end="")
    print(f" (coordinator {r.get('register_cpu_ms_per_site', 0):.2f} ms CPU per site)")
    if run:
        print(
            f"  run {run['state']}: {run['committed']}/{r['rounds_requested']} rounds committed, "
            f"{run.get('first_attempt', 0)} on their first attempt; round time median "
            f"{run.get('round_s_median') or 0:.2f} s, max {run.get('round_s_max') or 0:.2f} s"
        )
        if r.get("regions"):
            print(
                f"  the regions' CPU {_ms(run.get('regions_cpu_ms_per_site_round'), 2)} per site "
                f"per round (a regional run a round included); the upstream's "
                f"{_ms(run['cpu_ms_per_site_round'], 2)} per region per round", end=""
            )  # fmt: skip
        else:
            print(
                f"  coordinator CPU {_ms(run['cpu_ms_per_site_round'], 2)} per site per round",
                end="",
            )
        if run.get("reads_process_cpu_s") is not None:
            print(f" (its operators' read process: {run['reads_process_cpu_s']:.1f} s in the run)")
        else:
            print()
        if run.get("projected_sites"):
            how = (
                "regions an upstream serves x sites a region serves"
                if r.get("regions")
                else ("sites one coordinator serves")
            )
            print(f"  projected, at one CPU-second per second of round: {how}: "
                  f"{run['projected_sites']:,.0f}")  # fmt: skip
        if r.get("sites_cpu_ms_per_site_attempt") is not None:
            print(
                f"  the emulated sites (the workers): {r['sites_cpu_s']:.1f} s of CPU in the run, "
                f"{r['sites_cpu_ms_per_site_attempt']:.2f} ms per site per round's attempt"
            )
        gaps = ", ".join(f"{g:.1f}" for g in run.get("between_rounds_s", []))
        print(f"  run {run.get('run_s') or 0:.1f} s from round 0 opening to the last commit "
              f"(SubmitRun took {run['submit_s']:.2f} s, round 0 opened "
              f"{run.get('submit_to_round_0_s') or 0:.2f} s after it was sent); s from a commit "
              f"to the next round opening: {gaps or '-'}")  # fmt: skip
        port = "admin port" if run.get("admin_port") else "site port"
        opened = sorted((x["opened_unix_s"], x["number"]) for x in run.get("rounds", []))
        for name, a in run["admin"].items():
            slow = _when(a.get("slowest", []), opened)
            print(f"  admin {name} ({port}): p50 {_ms(a['p50_ms'])}, p99 {_ms(a['p99_ms'])}, "
                  f"{a['calls']} calls; slowest: {slow}")  # fmt: skip
        if wake := run.get("wake"):
            print(f"  an idle process at the coordinator's priority woke late by: p50 "
                  f"{_ms(wake['p50_ms'])}, p99 {_ms(wake['p99_ms'])}, max {_ms(wake['max_ms'])} "
                  f"({wake['over_50_ms']} times over 50 ms in {wake['wakes']} wake-ups): the "
                  f"machine's floor under the admin calls' latency")  # fmt: skip
        for problem, count in sorted(run["participation_problems"].items())[:5]:
            print(f"  participations {problem}: {count}")
    if r.get("regions"):  # the sites' coordinator is a region; the peak is the upstream's
        print(f"  region 0's RSS, threads: idle {_kb(r.get('idle'))}; connected "
              f"{_kb(r.get('connected'))}; growth {r.get('rss_growth_kb_per_site', 0):.1f} kB "
              f"per connected site; the upstream's peak in the run "
              f"{_kb(run.get('peak'))}")  # fmt: skip
    else:
        print(f"  coordinator RSS, threads: idle {_kb(r.get('idle'))}; connected "
              f"{_kb(r.get('connected'))}; peak in the run {_kb(run.get('peak'))}; growth "
              f"{r.get('rss_growth_kb_per_site', 0):.1f} kB per connected site")  # fmt: skip
    failed = {k: v for k, v in sites["calls"].items() if not k.endswith(" OK")}
    print(f"  site errors by code: {sites['errors_by_code'] or 'none'} (by call: "
          f"{failed or 'none'}); admin errors: {run.get('admin_errors') or 'none'}; "
          f"agents crashed: {sites['agents_crashed'] or 'none'}")  # fmt: skip
    print(f"  the workers' garbage collections: {sites.get('gc_full', 0)} full, "
          f"{sites.get('gc_total_s', 0.0):.2f} s in all, the longest "
          f"{sites.get('gc_longest_s', 0.0):.2f} s; the longest heartbeat (held ones too) in each: "
          f"{', '.join(f'{x:.1f}' for x in sites.get('heartbeat_longest_s', []))} s, the "
          f"longest between two of a task's: "
          f"{', '.join(f'{x:.1f}' for x in sites.get('heartbeat_gap_s', []))} s")  # fmt: skip
    gc_s, cpu_s = r.get("coordinator_gc_s"), run.get("coordinator_cpu_s")
    if gc_s is not None:
        share = f" ({100 * gc_s / cpu_s:.0f}% of its CPU in the run)" if cpu_s else ""
        by = r.get("coordinator_gc_s_by_generation") or {}
        gens = ", ".join(f"generation {g}: {v:.2f} s" for g, v in sorted(by.items()))
        print(f"  the coordinator's garbage collections: {gc_s:.2f} s in the run{share}"
              + (f" ({gens})" if gens else ""))  # fmt: skip
    late = r.get("coordinator_late") or {}
    if late:
        print(f"  the coordinator heard late: its sites' calls waited in gRPC's queue up to "
              f"{late['lag_max_s']:.1f} s (median over sites, logged {late['lag_logged']} "
              f"times); its loop stalled up to {late['stall_max_s']:.1f} s (logged "
              f"{late['stall_logged']} times)")  # fmt: skip
    stages = ", ".join(f"{k} {v:g}" for k, v in r["timeline_s"].items())
    print(f"  timeline (s from start): {stages}")
    for text, count in sorted(sites["warnings"].items(), key=lambda kv: -kv[1])[:5]:
        print(f"  site log x{count}: {text}")
    if "failure" in r:
        print(f"  FAILED: {r['failure']}")
        for line in r.get("coordinator_log_tail", "").splitlines()[-5:]:
            print(f"    coordinator: {line}")
    for aim in r["aims"]:
        verdict = "met" if aim["met"] else "NOT MET"
        at = aim["stated_for_sites"]
        where = "" if at is None or at == n else f" (stated for N={at}; here for reference)"
        print(f"  aim: {aim['text']}: {verdict} ({_aim_value(aim, r)}){where}")


def _aim_value(aim: dict[str, Any], r: dict[str, Any]) -> str:
    value = aim["value"]
    if value is None:
        return "not measured"
    if aim["aim"] == "first_attempt":
        return f"{value}/{r['rounds_requested']} rounds"
    return f"{value:.1f} {'kB' if aim['aim'] == 'rss' else 'ms'}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", default="100,1000", help="comma-separated N, e.g. 100,1000")
    parser.add_argument("--rounds", type=int, default=3, help="training rounds after round 0")
    parser.add_argument("--procs", type=int, default=4, help="worker processes hosting sites")
    parser.add_argument(
        "--regions",
        default="0",
        help="comma-separated region counts, each N measured with each: 0 is flat (one "
        "coordinator); R > 0 is an upstream and R regional coordinators (--upstream), site i "
        "under region i %% R, each region its own SQLite, e.g. 0,2",
    )
    parser.add_argument("--db", default="sqlite", help="sqlite, or a PostgreSQL URL under "
                        "which a fresh database is made for each N")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per N, all included")
    parser.add_argument("--round-deadline-s", type=float, default=300.0)
    parser.add_argument("--admin-hz", type=float, default=4.0, help="ListSites and GetRun")
    parser.add_argument(
        "--status-probe", choices=("summary", "pages"), default="summary",
        help="GetRun as `fedra run status` asks for it (counts), or its first page of rows "
        "(the probe until 2026-12-06)",
    )  # fmt: skip
    parser.add_argument(
        "--site-nice",
        type=int,
        default=19,
        help="the worker processes' niceness, of their threads and of their sessions' "
        "scheduling groups (default: 19, the lowest priority): real sites have machines of "
        "their own, and at 10 (the default until 2026-12-06) an idle process at the "
        "coordinator's priority waited up to 180 ms for a CPU while they ran; where the sites "
        "need most of the machine (10,000 on two cores) they starve at 19: give 10; 0: the same",
    )
    parser.add_argument(
        "--site-cpus",
        default="",
        help="run the workers on these CPUs only (e.g. '1' or '2-3'; default: all), leaving "
        "the others to the coordinator alone",
    )
    parser.add_argument(
        "--site-turns",
        type=int,
        default=None,
        help="how many of a worker's sites work on their task at once (download, training, "
        "until the upload begins), the others waiting their turn while they heartbeat; "
        "0: all at once "
        "(default 16, and 0 with --fit-delay-s, whose sleep would hold a turn)",
    )
    parser.add_argument(
        "--worker-gc",
        choices=("off", "on"),
        default="off",
        help="the worker processes' automatic garbage collection (default off, what they "
        "built frozen first: a worker's collections stop all of its sites at once, which sites "
        "of their own do not see); on: Python's default",
    )
    parser.add_argument(
        "--site-transport",
        choices=("aio", "sync"),
        default="aio",
        help="the gRPC under each site's Connection: aio (default), its asyncio channel on "
        "one event loop a worker, offered through the synchronous API (bench/sync_over_aio.py); "
        "sync, gRPC's synchronous channel, whose waits wake every 200 ms each",
    )
    parser.add_argument(
        "--coordinator-flags",
        default="",
        help="more flags for `fedra coordinator`, e.g. '--workers 8' (default: none, its defaults)",
    )
    parser.add_argument("--work-dir", type=Path, help="keep state and logs here (default: temp)")
    parser.add_argument(
        "--fit-delay-s",
        type=float,
        default=0.0,
        help="each site's training sleeps this long first (the synthetic task's fit_delay_s); "
        "past the heartbeat interval (5 s) every site heartbeats during its task",
    )
    # The worker's own flags: not for people.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--wake-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stats", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (args.worker or args.wake_probe):
        args.sizes = [int(s) for s in args.sites.split(",") if s.strip()]
        if not args.sizes or min(args.sizes) < 1 or args.rounds < 1 or args.procs < 1:
            parser.error("--sites, --rounds and --procs must be positive")
        try:
            args.region_counts = [int(x) for x in args.regions.split(",") if x.strip()]
        except ValueError:
            parser.error(f"--regions: not a list of counts: {args.regions!r}")
        if not args.region_counts or min(args.region_counts) < 0:
            parser.error("--regions: counts of 0 (flat) or more")
        if max(args.region_counts) > min(args.sizes):
            parser.error("--regions: each region needs a site (a count above the smallest N)")
        if args.db != "sqlite" and not args.db.startswith("postgresql"):
            parser.error("--db: sqlite or a postgresql URL")
    if args.site_turns is None:
        args.site_turns = 0 if args.fit_delay_s > 0 else 16
    if args.site_turns < 0:
        parser.error("--site-turns must be 0 (all at once) or positive")
    if args.site_cpus:
        try:
            cpus = cpu_list(args.site_cpus)
        except ValueError as exc:
            parser.error(str(exc))
        if not cpus <= os.sched_getaffinity(0):
            parser.error(f"--site-cpus {args.site_cpus}: this machine has CPUs "
                         f"{sorted(os.sched_getaffinity(0))}")  # fmt: skip
    return args


def _interrupted(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wake_probe:
        wake_probe_main()
        return 0
    if args.worker:
        worker_main(args)
        return 0
    signal.signal(signal.SIGTERM, _interrupted)
    results: list[dict[str, Any]] = []
    interrupted = False
    try:
        for n in args.sizes:
            for regions in args.region_counts:
                results.append(measure(n, regions, args))
                print_result(results[-1])
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: everything started was stopped", file=sys.stderr)
    if args.out:
        doc = {"results": results, "interrupted": interrupted, "db": args.db.split("://")[0]}
        doc["sites_run"] = {
            "nice": args.site_nice,
            "cpus": args.site_cpus or "all",
            "transport": args.site_transport,
        }
        doc["cpus"], doc["load_average"] = os.cpu_count(), os.getloadavg()[0]
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
