"""Hostile input against a real coordinator (mTLS, real engine, SQLite, blob stores).

Property-based: every RPC of the site and admin services gets random and mutated bytes,
hostile field values, mangled upload streams and broken safetensors payloads, forged
identities and replays. After each example the daemon must serve a legitimate call,
the refusal must carry a deliberate status (never INTERNAL or UNKNOWN) and a message,
nothing may have changed in the database or the blob stores, and the log may hold no
traceback and no forged or flooded line; at the end the honest round still completes.

CI runs the ``ci`` profile (tests/conftest.py); FEDRA_HOSTILE_EXAMPLES=500 runs more.
"""

from __future__ import annotations

import functools
import json
import os
import random
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import assume, given
from hypothesis import strategies as st

from fedra.protos.codec import encode
from fedra.protos.v1 import admin_pb2, site_pb2
from tests.hostile_arena import (
    ATTACKER,
    DELIBERATE,
    HONEST,
    TALLY,
    Arena,
    arena,
    check_refusal,
    delta,
)
from tests.hostile_inputs import (
    OVERSIZED,
    RPCS,
    Rpc,
    bad_payload,
    base_messages,
    frame,
    hostile_bytes,
    hostile_text,
    mangled_stream,
)

pytestmark = pytest.mark.timeout(300)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module", autouse=True)
def _figures() -> Iterator[None]:
    """FEDRA_HOSTILE_REPORT=FILE: write how many hostile calls were made, by outcome."""
    yield
    path = os.environ.get("FEDRA_HOSTILE_REPORT")
    if path:
        figures = {"calls": sum(TALLY.values()), "by_status": dict(sorted(TALLY.items()))}
        Path(path).write_text(json.dumps(figures, indent=1))


# The daemon's memory may not grow with what attackers send: the peak of this process
# (the daemon runs in it) over one test stays under this, whatever the examples were.
PEAK_GROWTH_BYTES = 256 * 2**20


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Arena]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    with arena(tmp_path) as a:
        yield a
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < PEAK_GROWTH_BYTES, f"the peak RSS grew by {grown >> 20} MiB under attack"


def caller(rpc: Rpc) -> str:
    """Admin calls come from the admin (to reach the handlers), site calls from mallory."""
    return "ops" if rpc.admin else ATTACKER


def test_random_and_mutated_bytes_reach_every_rpc(coordinator: Arena) -> None:
    a = coordinator
    bases = {rpc.path: base_messages(a, rpc) for rpc in RPCS}

    @given(data=st.data())
    def attack(data: st.DataObject) -> None:
        rpc = data.draw(st.sampled_from(RPCS))
        chunks = hostile_bytes(bases[rpc.path])
        raw = data.draw(st.lists(chunks, max_size=4) if rpc.streams_in else chunks)
        before = a.snapshot()
        check_refusal(functools.partial(rpc.invoke, a.channel(caller(rpc)), raw), f"{rpc}")
        a.after_attack(before, f"{rpc} {raw!r:.200}")

    attack()
    a.finish_round()


def _with_fields(base: Message, draw: st.DrawFn) -> bytes:
    """``base`` with each string field replaced, maybe, by hostile text."""
    message = type(base)()
    message.CopyFrom(base)
    for field in message.DESCRIPTOR.fields:
        if field.type == field.TYPE_STRING and draw(st.booleans()):
            value = draw(hostile_text)
            if field.is_repeated:
                getattr(message, field.name).append(value)
            else:
                setattr(message, field.name, value)
    return message.SerializeToString()


def test_hostile_text_in_every_field_is_refused_and_never_forges_the_log(
    coordinator: Arena,
) -> None:
    a = coordinator
    unary = [rpc for rpc in RPCS if not rpc.streams_in]
    bases = {rpc.path: base_messages(a, rpc) for rpc in unary}
    spec = admin_pb2.RunSpec(sites_per_round=1, strategy="fedavg")  # rounds unset: invalid

    @given(data=st.data())
    def attack(data: st.DataObject) -> None:
        rpc = data.draw(st.sampled_from(unary))
        if rpc.name == "SubmitRun":
            spec.task, spec.name = data.draw(hostile_text), data.draw(hostile_text)
            raw = admin_pb2.SubmitRunRequest(spec=spec).SerializeToString()
        else:
            raw = _with_fields(data.draw(st.sampled_from(bases[rpc.path])), data.draw)
        before = a.snapshot()
        check_refusal(functools.partial(rpc.invoke, a.channel(caller(rpc)), raw), f"{rpc}")
        a.after_attack(before, f"{rpc} {raw!r:.200}")

    attack()
    a.finish_round()


def test_mangled_upload_streams_are_refused(coordinator: Arena) -> None:
    a = coordinator
    task = a.tasks["site-a"]
    payload = encode(delta(0.5))

    @given(data=st.data())
    def attack(data: st.DataObject) -> None:
        messages = [m.SerializeToString() for m in a.upload_messages("site-a", task, payload)]
        messages = messages[:1] + _rechunk(payload, data.draw(st.integers(8, 64)))
        raw = data.draw(mangled_stream(messages))
        assume(raw != messages)
        before = a.snapshot()
        rpc = next(r for r in RPCS if r.name == "UploadUpdate")
        code = check_refusal(functools.partial(rpc.invoke, a.channel("site-a"), raw), "stream")
        assert code in (INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED), code
        a.after_attack(before, f"stream {raw!r:.300}")

    attack()
    a.finish_round()


def _rechunk(payload: bytes, size: int) -> list[bytes]:
    pieces = [payload[i : i + size] for i in range(0, len(payload), size)]
    return [site_pb2.UpdateChunk(data=p).SerializeToString() for p in pieces]


def test_broken_safetensors_payloads_are_refused(coordinator: Arena) -> None:
    a = coordinator
    task = a.tasks["site-a"]

    @given(payload=bad_payload(), chunk=st.integers(1, 4096))
    def attack(payload: bytes, chunk: int) -> None:
        messages = a.upload_messages("site-a", task, payload, chunk=chunk)
        before = a.snapshot()
        call = functools.partial(a.site("site-a").UploadUpdate, iter(messages), timeout=30)
        code = check_refusal(call, f"payload {payload!r:.300}")
        assert code in (INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED), code
        a.after_attack(before, f"payload {payload!r:.300}")

    attack()
    a.finish_round()


def test_a_refused_upload_is_undone_before_the_refusal_is_sent(coordinator: Arena) -> None:
    """A retry sent the moment a refusal arrives finds the task the site's again: the
    give-back happens before the status goes out, not in the executor some time later.
    Made exact by holding the engine's lock from the moment the upload has begun, so
    that a give-back left for later could not have run when the refusal arrived."""
    a = coordinator
    task = a.tasks["site-a"]
    messages = a.upload_messages("site-a", task, b"\x00" * 7, chunk=1)
    before = a.snapshot()
    last_chunk = threading.Event()

    def stream() -> Iterator[site_pb2.UpdateChunk]:
        yield from messages[:-1]
        last_chunk.wait(30)
        yield messages[-1]

    def state() -> str:
        run = a.engine.runs[task.run_id]
        return next(x.state for x in run.assignments.values() if x.site_id == "site-a")

    start = state()
    outcome: list[grpc.StatusCode] = []
    call = functools.partial(a.site("site-a").UploadUpdate, stream(), timeout=30)
    caller = threading.Thread(target=lambda: outcome.append(check_refusal(call, "zeros")))
    caller.start()
    try:
        deadline = time.monotonic() + 20
        while state() == start and time.monotonic() < deadline:
            time.sleep(0.005)  # readiness poll: until the coordinator holds the upload
        assert state() != start, "the upload never began"
        with a.engine._lock:
            last_chunk.set()
            caller.join(1.0)  # it may not answer while the give-back waits for the lock
            if not caller.is_alive():  # answered: then it must have been undone already
                assert a.snapshot() == before, "refused before the task was given back"
        caller.join(30)
    finally:
        last_chunk.set()
        caller.join(30)
    assert outcome == [INVALID]
    a.after_attack(before, "zeros")


def _identity_attacks(a: Arena) -> dict[str, tuple[object, set[grpc.StatusCode]]]:
    """Named attacks: (a call, the statuses it may end with)."""
    task_a, task_b = a.tasks["site-a"], a.tasks["site-b"]
    good = encode(delta(0.5))
    denied = {grpc.StatusCode.PERMISSION_DENIED}
    init, init_nonce = a.init_site, a.init_messages[0].header.nonce
    reused = a.upload_messages(init, a.tasks[init], good, nonce=init_nonce)  # signed
    return {
        "mallory replays the accepted initial update": (
            lambda: a.site(ATTACKER).UploadUpdate(iter(a.init_messages), timeout=30), denied),
        "the initial update again, from its site": (  # a retry after a lost reply: no change
            lambda: a.site(a.init_site).UploadUpdate(iter(a.init_messages), timeout=30),
            {grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION}),
        "signed with another site's key": (
            lambda: a.site("site-a").UploadUpdate(
                iter(a.upload_messages("site-a", task_a, good, key_of="site-b")), timeout=30),
            {grpc.StatusCode.UNAUTHENTICATED}),
        "header altered after signing": (
            lambda: a.site("site-a").UploadUpdate(
                iter(a.upload_messages("site-a", task_a, good, num_samples=10**6)), timeout=30),
            {grpc.StatusCode.UNAUTHENTICATED}),
        "mallory uploads for site-a's task": (
            lambda: a.site(ATTACKER).UploadUpdate(
                iter(a.upload_messages(ATTACKER, task_a, good)), timeout=30), denied),
        "site-a uploads for site-b's task": (
            lambda: a.site("site-a").UploadUpdate(
                iter(a.upload_messages("site-a", task_b, good)), timeout=30), denied),
        "a signed update reusing an accepted update's nonce": (
            lambda: a.site(init).UploadUpdate(iter(reused), timeout=30),
            {grpc.StatusCode.ALREADY_EXISTS}),
        "mallory reports site-a's task as failed": (
            lambda: a.site(ATTACKER).ReportFailure(site_pb2.ReportFailureRequest(
                site_id="site-a", task_id=task_a.task_id, reason="x"), timeout=10), denied),
        "mallory downloads site-b's model": (
            lambda: list(a.site(ATTACKER).DownloadModel(site_pb2.DownloadModelRequest(
                site_id=ATTACKER, task_id=task_b.task_id), timeout=10)), denied),
        "mallory cancels the run": (
            lambda: a.admin(ATTACKER).CancelRun(
                admin_pb2.CancelRunRequest(run_id=a.run_id), timeout=10), denied),
        "the admin acts as site-a": (
            lambda: a.site("ops").Heartbeat(site_pb2.HeartbeatRequest(
                site_id="site-a", task_id=task_a.task_id), timeout=10), denied),
    }  # fmt: skip


def _naming(rpc: Rpc, site_id: str) -> bytes:
    """A request of ``rpc`` that says it comes from ``site_id``."""
    if rpc.name == "UploadUpdate":
        header = site_pb2.UpdateHeader(site_id=site_id)
        return site_pb2.UpdateChunk(header=header).SerializeToString()
    if rpc.name == "UploadSmallUpdate":
        header = site_pb2.UpdateHeader(site_id=site_id)
        return site_pb2.UploadSmallUpdateRequest(header=header).SerializeToString()
    message = rpc.request()
    message.site_id = site_id  # type: ignore[attr-defined]
    return message.SerializeToString()  # type: ignore[no-any-return]


def test_forged_identities_and_replays_are_refused(coordinator: Arena) -> None:
    a = coordinator
    attacks = _identity_attacks(a)

    site_rpcs = [rpc for rpc in RPCS if not rpc.admin]

    @given(
        name=st.sampled_from(sorted(attacks)),
        rpc=st.sampled_from(site_rpcs),
        forged=st.sampled_from([*HONEST, "ops", ""]),
    )
    def attack(name: str, rpc: Rpc, forged: str) -> None:
        call, allowed = attacks[name]
        before = a.snapshot()
        assert check_refusal(call, name) in allowed, name  # type: ignore[arg-type]
        # And any site call from mallory naming another site.
        raw = _naming(rpc, forged)
        code = check_refusal(functools.partial(rpc.invoke, a.channel(ATTACKER), raw), str(rpc))
        assert code == grpc.StatusCode.PERMISSION_DENIED, (rpc, forged, code)
        a.after_attack(before, name)

    attack()
    a.finish_round()


def test_an_honest_round_completes_beside_an_attack(coordinator: Arena) -> None:
    """Mallory sends random and mutated bytes to every RPC from two threads while the
    honest sites download and upload: the round commits with their exact mean."""
    a = coordinator
    bases = {rpc.path: [m.SerializeToString() for m in base_messages(a, rpc)] for rpc in RPCS}
    stop, seen, failures = threading.Event(), [], []

    def attacker(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            rpc = rng.choice(RPCS)
            raw = bytearray(rng.choice(bases[rpc.path]))
            for _ in range(rng.randint(0, 3)):
                if raw:
                    raw[rng.randrange(len(raw))] = rng.randrange(256)
            call = functools.partial(rpc.invoke, a.channel(caller(rpc)), bytes(raw))
            try:
                seen.append(check_refusal(call, str(rpc)))
            except AssertionError as exc:
                failures.append(str(exc))

    threads = [threading.Thread(target=attacker, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    try:
        for s in HONEST:
            request = site_pb2.DownloadModelRequest(site_id=s, task_id=a.tasks[s].task_id)
            assert b"".join(m.data for m in a.site(s).DownloadModel(request, timeout=30))
        a.finish_round()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not failures, failures[:5]
    assert len(seen) > 10 and set(seen) <= DELIBERATE | {grpc.StatusCode.OK}
    assert not a.log.problems()


# -- the faults this suite was built for, one example each --------------------------


def test_a_malformed_request_is_invalid_argument_without_a_traceback(coordinator: Arena) -> None:
    """Bytes that do not parse as the RPC's request: INVALID_ARGUMENT naming that, before
    any other work (no identity check, no handler), and no traceback in the log."""
    a = coordinator
    before = a.snapshot()
    # Wire type 7 does not exist; a length past the end; a string that is not UTF-8
    # (that one only where field 1 is a string or message: elsewhere it is an unknown field).
    for rpc in RPCS:
        first = rpc.request.DESCRIPTOR.fields[:1]
        bad_utf8 = (
            [b"\x0a\x03\x0a\x01\xff"]
            if first and first[0].type in (first[0].TYPE_STRING, first[0].TYPE_MESSAGE)
            else []
        )
        for raw in [b"\xff\xff\xff", b"\x12\x05ab", *bad_utf8]:
            with pytest.raises(grpc.RpcError) as info:
                reply = rpc.invoke(a.channel(caller(rpc)), raw)
                if rpc.streams_out:
                    list(reply)
            assert info.value.code() == INVALID, (rpc, raw, info.value.details())
            assert "is not a valid message of this RPC" in info.value.details()
    a.after_attack(before, "malformed requests")
    a.finish_round()


def test_a_header_longer_than_the_model_needs_is_refused_from_its_length(
    coordinator: Arena,
) -> None:
    """An update padded with metadata, or a header of many empty entries: a declared size
    past what the expected model needs is refused before a byte of payload is read, and
    a header longer than the model needs is refused by its 8-byte length prefix."""
    a = coordinator
    task = a.tasks["site-a"]
    padded = encode(delta(0.5), metadata={"pad": "p" * 60_000})
    empty = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(9000)}
    entries = json.dumps(empty).encode()
    flood = len(entries).to_bytes(8, "little") + entries
    before = a.snapshot()
    cases = [
        (padded, grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the 4452 bytes this update can take"),
        (flood, grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the 4452 bytes"),
        # Within the declared size, but the prefix asks for more than the model needs.
        (padded[:4000], INVALID, f"header length {len(padded) - 44} exceeds 4408 bytes (what"),
        (flood[:4000], INVALID, f"header length {len(entries)} exceeds 4408 bytes"),
    ]
    for payload, code, text in cases:
        messages = a.upload_messages("site-a", task, payload, chunk=65536)
        with pytest.raises(grpc.RpcError) as info:
            a.site("site-a").UploadUpdate(iter(messages), timeout=30)
        assert info.value.code() == code, info.value.details()
        assert text in info.value.details()
    a.after_attack(before, "oversized headers")
    a.finish_round()


def test_remote_text_is_escaped_and_cut_in_the_log_and_the_status(coordinator: Arena) -> None:
    """A megabyte-long id is cut in the refusal's log line and in the status sent back;
    a reported failure reason with a newline writes one line, escaped, and is stored so."""
    a = coordinator
    huge = "x" * 2**20
    with pytest.raises(grpc.RpcError) as info:
        a.site(ATTACKER).Heartbeat(site_pb2.HeartbeatRequest(site_id=huge), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    details = info.value.details()
    assert details.endswith(f"... ({len(huge) + 48} characters)") and len(details) < 1100
    (line,) = [r.getMessage() for r in a.log.records if "may only act as itself" in r.getMessage()]
    assert line.endswith(f"... ({len(huge) + 48} characters)") and len(line) < 600
    a.log.records.clear()

    reason = "boom\nCRITICAL fedra.coordinator: forged \x1b[2J" + "y" * 5000
    request = site_pb2.ReportFailureRequest(
        site_id="site-a", task_id=a.tasks["site-a"].task_id, reason=reason
    )
    a.site("site-a").ReportFailure(request, timeout=10)
    (line,) = [r.getMessage() for r in a.log.records if "failed its task" in r.getMessage()]
    assert "boom\\nCRITICAL fedra.coordinator: forged \\x1b[2J" in line and len(line) < 600
    assert not a.log.problems()
    stored = a.engine._store.get_participation(a.tasks["site-a"].task_id)
    assert stored is not None and "\n" not in stored.error and "\x1b" not in stored.error
    assert stored.error.startswith("site reported: boom\\nCRITICAL")


def test_an_oversized_message_after_a_whole_payload_is_not_accepted(coordinator: Arena) -> None:
    """gRPC ends the request stream the same way when the transport refuses a message
    over the size limit as when the caller closes it; the site is told RESOURCE_EXHAUSTED,
    so the update must not count (it did, now and then, before wire._check_stream_closed)."""
    a = coordinator
    task = a.tasks["site-a"]
    rpc = next(r for r in RPCS if r.name == "UploadUpdate")
    before = a.snapshot()
    for _ in range(8):  # the race went the wrong way about one time in ten (and see
        # test_input_bounds.py for the same, deterministic)
        messages = a.upload_messages("site-a", task, encode(delta(0.5)), chunk=16)
        raw = [m.SerializeToString() for m in messages] + [frame(b"\0" * OVERSIZED)]
        call = functools.partial(rpc.invoke, a.channel("site-a"), raw)
        assert check_refusal(call, "oversized tail") == grpc.StatusCode.RESOURCE_EXHAUSTED
        a.after_attack(before, "a whole payload, then an oversized message")
    a.finish_round()
