"""SecAgg+ end to end in one process: real crypto, real dropouts, the site-side defences."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import pytest
import torch

from fedra.secagg import (
    MASK_SEED_LABEL,
    MODULUS,
    PUBLIC_KEYS_LEN,
    REVEAL_B,
    REVEAL_S,
    SHARE_KEY_LABEL,
    SHARE_LEN,
    RoundPlan,
    SecAggError,
    ServerSecAgg,
    SiteSecAgg,
    _agree,
    _seal,
    _share_plaintext,
    dequantise_sum,
    plan_round,
    prg,
    quant_bits,
    quantise,
    shamir_combine,
    shamir_split,
    share_threshold,
)

CLIP = 1.0
LENGTH = 3001


def ids(n: int) -> list[str]:
    return [f"site-{i:02d}" for i in range(n)]


def pieces(y: torch.Tensor, size: int = 700) -> Iterator[tuple[int, torch.Tensor]]:
    """Out-of-order pieces, to show the coordinator does not rely on order."""
    offsets = list(range(0, y.numel(), size))
    for off in reversed(offsets):
        yield off, y[off : off + size]


@dataclass
class Outcome:
    server: ServerSecAgg
    sites: dict[str, SiteSecAgg]
    inputs: dict[str, torch.Tensor]
    result: torch.Tensor
    count: int

    def expected_int(self) -> torch.Tensor:
        total = torch.zeros(LENGTH, dtype=torch.int64)
        for site in self.server.survivors:
            total += quantise(self.inputs[site], CLIP, self.server.bits)
        return total


def run_protocol(
    n: int,
    *,
    degree: int = 0,
    threshold: float = 0.5,
    silent: Collection[str] = (),
    before_share: Collection[str] = (),
    after_share: Collection[str] = (),
    after_mask: Collection[str] = (),
    length: int = LENGTH,
) -> Outcome:
    """One round; sites in ``silent`` never advertise, the others drop at the named stage."""
    names = ids(n)
    plan = plan_round(names, degree=degree, threshold=threshold, seed=b"plan-seed")
    context = b"round-7/attempt-1/" + os.urandom(8)
    bits = quant_bits(n)
    server = ServerSecAgg(plan, context, length, clip=CLIP, bits=bits)
    gen = torch.Generator().manual_seed(n)
    inputs = {s: torch.randn(length, generator=gen) * 0.4 for s in names}
    sites = {s: SiteSecAgg(s, plan.threshold, context) for s in names}
    for s in names:
        if s not in silent:
            server.advertise(s, sites[s].public_keys())
    server.close_advertise()
    for s in names:
        if s not in silent and s not in before_share:
            server.post_shares(s, sites[s].share_keys(server.neighbour_keys(s)))
    server.close_shares()
    for s in server.plan.participants:
        if s in silent or s in before_share or s in after_share:
            continue
        sites[s].receive_shares(server.inbox(s))
        server.add_masked(s, pieces(sites[s].mask(inputs[s], clip=CLIP, bits=bits)))
    server.close_masked()
    for s in server.survivors:
        if s not in after_mask:
            survivors, dropped = server.unmask_request(s)
            server.post_reveal(s, sites[s].reveal(survivors, dropped))
    result, count = server.finish(chunk=1024)
    return Outcome(server, sites, inputs, result, count)


def check_sum(out: Outcome, expected_survivors: Collection[str]) -> None:
    assert set(out.server.survivors) == set(expected_survivors)
    assert out.count == len(expected_survivors)
    total = out.server.quantised_sum
    assert total is not None
    assert torch.equal(total, out.expected_int())
    plain = sum(out.inputs[s].clamp(-CLIP, CLIP) for s in expected_survivors)
    assert isinstance(plain, torch.Tensor)
    step = 2 * CLIP / ((1 << out.server.bits) - 1)
    err = (out.result.double() - plain.double()).abs().max().item()
    assert err <= out.count * step / 2 + 1e-5
    assert torch.allclose(out.result, dequantise_sum(total, out.count, CLIP, out.server.bits))


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(("n", "degree"), [(3, 0), (7, 0), (10, 4)])
def test_no_dropouts(n: int, degree: int) -> None:
    out = run_protocol(n, degree=degree)
    check_sum(out, ids(n))
    assert out.server.stage == "done"
    assert out.server.dropped == ()
    if degree:
        assert all(len(v) == degree for v in out.server.plan.neighbours.values())


def test_silent_and_dropout_before_sharing() -> None:
    names = ids(7)
    out = run_protocol(7, silent=[names[0]], before_share=[names[3]])
    check_sum(out, set(names) - {names[0], names[3]})
    assert out.server.dropped == (names[0], names[3])


@pytest.mark.parametrize("degree", [0, 4])
def test_dropout_after_sharing_removes_pairwise_masks(degree: int) -> None:
    names = ids(10)
    out = run_protocol(10, degree=degree, after_share=[names[2], names[5]])
    check_sum(out, set(names) - {names[2], names[5]})


def test_dropout_after_masking_keeps_input() -> None:
    names = ids(7)
    out = run_protocol(7, after_mask=[names[1], names[6]])
    check_sum(out, names)


def test_mixed_dropouts_sparse_graph() -> None:
    names = ids(10)
    out = run_protocol(
        10,
        degree=6,
        silent=[names[9]],
        before_share=[names[0]],
        after_share=[names[4]],
        after_mask=[names[7]],
    )
    check_sum(out, set(names) - {names[9], names[0], names[4]})


def test_too_many_dropouts_after_sharing_refused() -> None:
    names = ids(5)  # complete graph: k = 4, t = 2, quorum 3
    with pytest.raises(SecAggError, match=r"only 2 sites sent masked input, need at least 3"):
        run_protocol(5, after_share=names[:3])


def test_too_many_dropouts_before_sharing_refused() -> None:
    names = ids(5)
    with pytest.raises(SecAggError, match=r"only 2 sites posted shares"):
        run_protocol(5, before_share=names[:3])


def test_too_many_dropouts_after_masking_refused_by_finish() -> None:
    names = ids(5)
    with pytest.raises(SecAggError, match=r"cannot unmask: b:site-03 has 1 of 2 shares"):
        run_protocol(5, after_mask=names[:3])


def _masked(
    plan: RoundPlan, context: bytes, length: int, masking: list[str]
) -> tuple[dict[str, SiteSecAgg], ServerSecAgg]:
    """Every participant through the key exchange; those in ``masking`` send zeros."""
    sites = {s: SiteSecAgg(s, plan.threshold, context) for s in plan.participants}
    server = ServerSecAgg(plan, context, length, clip=CLIP, bits=8)
    for s in plan.participants:
        server.advertise(s, sites[s].public_keys())
    server.close_advertise()
    for s in plan.participants:
        server.post_shares(s, sites[s].share_keys(server.neighbour_keys(s)))
    server.close_shares()
    for s in masking:
        sites[s].receive_shares(server.inbox(s))
        server.add_masked(s, [(0, sites[s].mask(torch.zeros(length), clip=CLIP, bits=8))])
    return sites, server


def test_too_few_survivors_refused_by_reveal() -> None:
    # Sparse ring (k = 2, t = 2): a site whose two neighbours both dropped refuses to reveal.
    names = ids(6)
    plan = plan_round(names, degree=2, threshold=1.0, seed=b"ring")
    victim = names[0]
    gone = list(plan.neighbours[victim])
    sites, server = _masked(plan, b"ctx", 64, masking=[s for s in names if s not in gone])
    server.close_masked()
    survivors, dropped = server.unmask_request(victim)
    assert survivors == [] and sorted(dropped) == sorted(gone)
    with pytest.raises(SecAggError, match=r"1 survivors \(counting itself\), need 2"):
        sites[victim].reveal(survivors, dropped)
    with pytest.raises(SecAggError, match=r"cannot unmask"):
        server.finish()
    assert server.missing()[f"b:{victim}"] == 2


# --------------------------------------------------------------------------- site defences


def _masked_trio() -> tuple[RoundPlan, dict[str, SiteSecAgg], ServerSecAgg]:
    plan = plan_round(ids(5), threshold=0.75, seed=b"s")  # k = 4, t = 3
    sites, server = _masked(plan, b"ctx-reveal", 16, masking=list(plan.participants))
    return plan, sites, server


def test_reveal_refuses_peer_named_both_ways() -> None:
    _, sites, _ = _masked_trio()
    a, b, c, d, e = ids(5)
    with pytest.raises(SecAggError, match=r"named survivor and dropped"):
        sites[a].reveal([b, c, d], [d, e])
    out = sites[a].reveal([b, c, d], [e])  # the refusal changed nothing
    assert {k: v[0] for k, v in out.items()} == {b: REVEAL_B, c: REVEAL_B, d: REVEAL_B, e: REVEAL_S}
    assert all(len(v) == 1 + SHARE_LEN for v in out.values())


def test_reveal_refuses_second_different_request() -> None:
    _, sites, _ = _masked_trio()
    a, b, c, d, e = ids(5)
    first = sites[a].reveal([b, c, d, e], [])
    assert sites[a].reveal([e, d, c, b], set()) == first  # same sets: same answer
    with pytest.raises(SecAggError, match=r"second reveal"):
        sites[a].reveal([b, c, d], [e])  # would hand out e's s-share after its b-share


def test_reveal_refuses_few_survivors_and_strangers() -> None:
    _, sites, _ = _masked_trio()
    a, b, c, d, e = ids(5)
    with pytest.raises(SecAggError, match=r"2 survivors \(counting itself\), need 3"):
        sites[a].reveal([b], [c, d, e])
    with pytest.raises(SecAggError, match=r"not live neighbours"):
        sites[a].reveal([b, c, "mallory"], [])
    with pytest.raises(SecAggError, match=r"not live neighbours"):
        sites[a].reveal([a, b, c], [])
    with pytest.raises(SecAggError, match=r"reveal needs mask first"):
        SiteSecAgg("x", 1, b"c").reveal([], [])


def test_site_call_order_and_repeats() -> None:
    site = SiteSecAgg("a", 1, b"ctx")
    peer = SiteSecAgg("b", 1, b"ctx")
    with pytest.raises(SecAggError, match=r"needs share_keys first"):
        site.receive_shares({})
    with pytest.raises(SecAggError, match=r"needs receive_shares first"):
        site.mask(torch.zeros(4), clip=1.0, bits=8)
    with pytest.raises(SecAggError, match=r"own keys"):
        site.share_keys({"a": site.public_keys()})
    with pytest.raises(SecAggError, match=r"must be 64 bytes"):
        site.share_keys({"b": peer.public_keys()[:32]})
    with pytest.raises(SecAggError, match=r"0 neighbours advertised keys, need 1"):
        site.share_keys({})
    assert len(site.public_keys()) == PUBLIC_KEYS_LEN
    out = site.share_keys({"b": peer.public_keys()})
    with pytest.raises(SecAggError, match=r"already called"):
        site.share_keys({"b": peer.public_keys()})
    back = peer.share_keys({"a": site.public_keys()})
    with pytest.raises(SecAggError, match=r"unknown sender 'c'"):
        site.receive_shares({"c": back["a"]})
    site.receive_shares({"b": back["a"]})
    peer.receive_shares({"a": out["b"]})
    assert site.live_neighbours == ("b",)
    ya = site.mask(torch.full((8,), 0.5), clip=1.0, bits=8)
    yb = peer.mask(torch.full((8,), -0.5), clip=1.0, bits=8)
    with pytest.raises(SecAggError, match=r"mask was already called"):
        site.mask(torch.zeros(8), clip=1.0, bits=8)
    # The pairwise masks cancel: removing both self masks leaves 191 + 64.
    assert not torch.equal((ya + yb) % MODULUS, torch.full((8,), 255))
    clean = (ya + yb - prg(site._b, 0, 8) - prg(peer._b, 0, 8)) % MODULUS
    assert torch.equal(clean, torch.full((8,), 255))


# --------------------------------------------------------------------------- ciphertexts


def _pair(context: bytes = b"ctx") -> tuple[SiteSecAgg, SiteSecAgg, SiteSecAgg]:
    a, b, c = (SiteSecAgg(s, 2, context) for s in "abc")
    return a, b, c


def _share_all(trio: tuple[SiteSecAgg, ...]) -> dict[str, dict[str, bytes]]:
    keys = {s.site_id: s.public_keys() for s in trio}
    return {
        s.site_id: s.share_keys({k: v for k, v in keys.items() if k != s.site_id}) for s in trio
    }


def test_tampered_ciphertext_rejected() -> None:
    a, b, c = _pair()
    sent = _share_all((a, b, c))
    bad = bytearray(sent["a"]["b"])
    bad[-5] ^= 1
    with pytest.raises(SecAggError, match=r"site 'b': share from 'a' does not decrypt"):
        b.receive_shares({"a": bytes(bad), "c": sent["c"]["b"]})
    with pytest.raises(SecAggError, match=r"share from 'a' does not decrypt"):
        b.receive_shares({"a": sent["a"]["b"][:20], "c": sent["c"]["b"]})
    b.receive_shares({"a": sent["a"]["b"], "c": sent["c"]["b"]})  # refusals changed nothing


def test_ciphertext_for_other_recipient_rejected() -> None:
    a, b, c = _pair()
    sent = _share_all((a, b, c))
    with pytest.raises(SecAggError, match=r"share from 'a' does not decrypt"):
        b.receive_shares({"a": sent["a"]["c"], "c": sent["c"]["b"]})
    # A validly sealed share whose embedded recipient is wrong (only a's key could make it).
    key = _agree(a._c_sk, b.public_keys()[:32], SHARE_KEY_LABEL, b"ctx", "a", "b")
    share = shamir_split(os.urandom(32), 1, 1)[0]
    forged = _seal(key, b"ctx", _share_plaintext("a", "c", share, share))
    with pytest.raises(SecAggError, match=r"share from 'a' is addressed 'a' -> 'c'"):
        b.receive_shares({"a": forged, "c": sent["c"]["b"]})


def test_ciphertext_from_other_round_rejected() -> None:
    old = _pair(b"round-1")
    new = _pair(b"round-2")
    old_sent = _share_all(old)
    new_sent = _share_all(new)
    with pytest.raises(SecAggError, match=r"share from 'a' does not decrypt"):
        new[1].receive_shares({"a": old_sent["a"]["b"], "c": new_sent["c"]["b"]})
    # Same key pair, other context: the derived keys differ, so nothing carries over.
    sk = old[0]._s_sk
    pk = old[1].public_keys()[32:]
    assert _agree(sk, pk, MASK_SEED_LABEL, b"round-1", "a", "b") != _agree(
        sk, pk, MASK_SEED_LABEL, b"round-2", "a", "b"
    )
    assert _agree(sk, pk, MASK_SEED_LABEL, b"r", "a", "b") == _agree(
        old[1]._s_sk, old[0].public_keys()[32:], MASK_SEED_LABEL, b"r", "b", "a"
    )


# --------------------------------------------------------------------------- privacy sanity


def test_masked_vector_looks_uniform() -> None:
    names = ids(4)
    plan = plan_round(names, seed=b"u")
    context = b"ctx-uniform"
    n = 8192
    sites = {s: SiteSecAgg(s, plan.threshold, context) for s in names}
    keys = {s: sites[s].public_keys() for s in names}
    sent = {s: sites[s].share_keys({v: keys[v] for v in plan.neighbours[s]}) for s in names}
    for s in names:
        sites[s].receive_shares({v: sent[v][s] for v in plan.neighbours[s]})
    x = torch.zeros(n)
    y = sites[names[0]].mask(x, clip=CLIP, bits=8)
    diff = (y - quantise(x, CLIP, 8)) % MODULUS
    assert (diff != 0).float().mean().item() > 0.999
    assert abs(y.double().mean().item() / MODULUS - 0.5) < 0.02
    assert abs(y.double().std().item() / MODULUS - 12**-0.5) < 0.02
    # The top byte is uniform too (chi-square with 255 dof, far below a 1e-6 tail of ~370).
    counts = torch.bincount(y >> 24, minlength=256).double()
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2 < 370


# --------------------------------------------------------------------------- PRG


def test_prg_offsets_match_full_stream() -> None:
    seed = os.urandom(32)
    full = prg(seed, 0, 5000)
    assert full.dtype == torch.int64
    assert int(full.min()) >= 0 and int(full.max()) < MODULUS
    for off in (0, 1, 2, 3, 4, 5, 7, 63, 64, 1001, 4095, 4999):
        for n in (0, 1, 2, 3, 4, 5, 13):
            if off + n <= 5000:
                assert torch.equal(prg(seed, off, n), full[off : off + n]), (off, n)
    chunks = torch.cat([prg(seed, o, min(333, 5000 - o)) for o in range(0, 5000, 333)])
    assert torch.equal(chunks, full)


def test_prg_deterministic_and_seed_dependent() -> None:
    seed = bytes(range(32))
    assert torch.equal(prg(seed, 10, 100), prg(seed, 10, 100))
    assert not torch.equal(prg(seed, 0, 100), prg(bytes(32), 0, 100))
    # AES-256-CTR keystream read as little-endian uint32 from a zero counter.
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(64))
    expected = [int.from_bytes(stream[i : i + 4], "little") for i in range(0, 64, 4)]
    assert prg(seed, 0, 16).tolist() == expected
    with pytest.raises(SecAggError):
        prg(b"short", 0, 4)
    with pytest.raises(SecAggError):
        prg(seed, -1, 4)


# --------------------------------------------------------------------------- Shamir


def test_shamir_any_t_rebuild_fewer_do_not() -> None:
    secret = os.urandom(32)
    shares = shamir_split(secret, 3, 5)
    assert len(shares) == 5 and all(len(s) == SHARE_LEN for s in shares)
    import itertools

    for trio in itertools.combinations(shares, 3):
        assert shamir_combine(trio, 3) == secret
    assert shamir_combine(shares, 3) == secret
    for combo in itertools.combinations(shares, 2):
        with pytest.raises(SecAggError, match=r"need 3 distinct shares"):
            shamir_combine(combo, 3)
        try:
            wrong = shamir_combine(combo, 2)  # a lower-degree fit: not the secret
        except SecAggError:
            continue
        assert wrong != secret
    with pytest.raises(SecAggError, match=r"need 3 distinct shares"):
        shamir_combine([shares[0], shares[0], shares[1]], 3)
    assert shamir_combine(shamir_split(secret, 1, 1), 1) == secret
    with pytest.raises(SecAggError):
        shamir_split(secret, 4, 3)
    with pytest.raises(SecAggError):
        shamir_split(secret[:31], 1, 2)


# --------------------------------------------------------------------------- quantisation


def test_quantise_round_trip_and_clipping() -> None:
    bits = 16
    step = 2 * CLIP / ((1 << bits) - 1)
    x = torch.linspace(-0.999, 0.999, 1001)
    q = quantise(x, CLIP, bits)
    assert q.dtype == torch.int64 and int(q.min()) >= 0 and int(q.max()) <= (1 << bits) - 1
    back = dequantise_sum(q, 1, CLIP, bits)
    assert back.dtype == torch.float32
    assert (back - x).abs().max().item() <= step / 2 + 1e-6
    edges = quantise(torch.tensor([-5.0, -1.0, 0.0, 1.0, 5.0, float("inf")]), CLIP, bits)
    assert edges.tolist() == [0, 0, 32768, 65535, 65535, 65535]
    assert dequantise_sum(torch.tensor([0, 65535]), 1, CLIP, bits).tolist() == [-1.0, 1.0]
    assert dequantise_sum(torch.tensor([3 * 65535]), 3, CLIP, bits).item() == pytest.approx(3.0)
    with pytest.raises(SecAggError, match=r"NaN"):
        quantise(torch.tensor([float("nan")]), CLIP, bits)
    with pytest.raises(SecAggError, match=r"clip"):
        quantise(x, 0.0, bits)
    with pytest.raises(SecAggError, match=r"bits"):
        quantise(x, CLIP, 33)
    with pytest.raises(SecAggError, match=r"floating-point"):
        quantise(torch.arange(3), CLIP, bits)


def test_quant_bits_edges() -> None:
    assert quant_bits(1) == 31
    assert quant_bits(2) == 30
    assert quant_bits(3) == 30
    assert quant_bits(4) == 29
    assert quant_bits(7) == 29
    assert quant_bits(8) == 28
    assert quant_bits((1 << 24) - 1) == 8
    for n in (1, 2, 3, 4, 7, 8, 1000, (1 << 24) - 1):
        assert n * ((1 << quant_bits(n)) - 1) < MODULUS
    for bad in (0, -1, 1 << 24, True):
        with pytest.raises(SecAggError):
            quant_bits(bad)


# --------------------------------------------------------------------------- plan


def test_plan_complete_and_sparse() -> None:
    names = ids(9)
    full = plan_round(list(reversed(names)), seed=b"x")
    assert full.participants == tuple(names)
    assert all(full.neighbours[s] == tuple(v for v in names if v != s) for s in names)
    assert full.threshold == 4  # ceil(0.5 * 8)
    assert plan_round(names, degree=8, seed=b"x") == full
    for degree, expect in ((1, 2), (2, 2), (3, 4), (4, 4), (6, 6)):
        plan = plan_round(names, degree=degree, threshold=0.7, seed=b"seed")
        for s, nbrs in plan.neighbours.items():
            assert len(nbrs) == expect and s not in nbrs and list(nbrs) == sorted(nbrs)
            assert all(s in plan.neighbours[v] for v in nbrs)
        assert plan.threshold == max(1, -(-7 * expect // 10))
    assert plan_round(names, degree=7, threshold=1.0, seed=b"x").threshold == 8  # complete
    a = plan_round(names, degree=4, seed=b"one")
    assert a == plan_round(names, degree=4, seed=b"one")
    assert any(
        plan_round(names, degree=4, seed=bytes([i])).neighbours != a.neighbours for i in range(5)
    )
    assert plan_round(["b", "a"], seed=b"x").neighbours == {"a": ("b",), "b": ("a",)}


def test_plan_rejects_bad_input() -> None:
    for bad, match in (
        ([], "at least 2"),
        (["a"], "at least 2"),
        (["a", "a", "b"], "not unique"),
        (["a", ""], "non-empty"),
        ("ab", "not a string"),
    ):
        with pytest.raises(SecAggError, match=match):
            plan_round(bad, seed=b"x")
    for threshold in (0, 0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(SecAggError, match="threshold"):
            plan_round(["a", "b"], threshold=threshold, seed=b"x")
    with pytest.raises(SecAggError, match="degree"):
        plan_round(["a", "b"], degree=-1, seed=b"x")
    with pytest.raises(SecAggError, match="seed"):
        plan_round(["a", "b"], seed=b"")


# --------------------------------------------------------------------------- coordinator misuse


def test_server_misuse_is_refused_without_state_change() -> None:
    names = ids(4)
    plan = plan_round(names, seed=b"m")  # k = 3, t = 2
    context = b"ctx-misuse"
    sites = {s: SiteSecAgg(s, plan.threshold, context) for s in names}
    with pytest.raises(SecAggError, match=r"overflow"):
        ServerSecAgg(plan, context, 8, clip=CLIP, bits=31)
    server = ServerSecAgg(plan, context, 10, clip=CLIP, bits=quant_bits(4))
    a, b, c, d = names
    with pytest.raises(SecAggError, match=r"'eve': not a participant"):
        server.advertise("eve", sites[a].public_keys())
    with pytest.raises(SecAggError, match=r"site 'site-00': public keys must be 64 bytes"):
        server.advertise(a, b"short")
    with pytest.raises(SecAggError, match=r"neighbour_keys in stage advertise"):
        server.neighbour_keys(a)
    server.advertise(a, sites[a].public_keys())
    server.advertise(a, sites[a].public_keys())
    with pytest.raises(SecAggError, match=r"already advertised different keys"):
        server.advertise(a, sites[b].public_keys())
    with pytest.raises(SecAggError, match=r"only 1 sites advertised keys, need at least 3"):
        server.close_advertise()
    for s in (b, c, d):
        server.advertise(s, sites[s].public_keys())
    server.close_advertise()
    assert server.stage == "share"
    with pytest.raises(SecAggError, match=r"advertise in stage share"):
        server.advertise(a, sites[a].public_keys())
    sent = {s: sites[s].share_keys(server.neighbour_keys(s)) for s in names}
    with pytest.raises(SecAggError, match=r"missing \['site-03'\]"):
        server.post_shares(a, {k: v for k, v in sent[a].items() if k != d})
    with pytest.raises(SecAggError, match=r"wrong type or length"):
        server.post_shares(a, {**sent[a], d: sent[a][d][:-1]})
    with pytest.raises(SecAggError, match=r"inbox in stage share"):
        server.inbox(a)
    for s in names:
        server.post_shares(s, sent[s])
    with pytest.raises(SecAggError, match=r"already posted shares"):
        server.post_shares(a, sent[a])
    server.close_shares()
    masked = {}
    for s in names:
        sites[s].receive_shares(server.inbox(s))
        masked[s] = sites[s].mask(torch.linspace(-1, 1, 10), clip=CLIP, bits=quant_bits(4))
    y = masked[a]
    bad_uploads = [
        ([(0, y[:5])], r"cover 5 of 10"),
        ([(0, y[:6]), (5, y[5:])], r"overlaps"),
        ([(0, y[:5]), (5, y[5:]), (8, y[8:])], r"overlaps"),
        ([(0, y[:5]), (6, y[5:])], r"outside \[0, 10\)"),
        ([(0, y.to(torch.int32))], r"int64"),
        ([(0, torch.full((10,), MODULUS))], r"outside \[0, 2\*\*32\)"),
        ([(0, torch.full((10,), -1))], r"outside \[0, 2\*\*32\)"),
    ]
    for bad, match in bad_uploads:
        with pytest.raises(SecAggError, match=match):
            server.add_masked(a, bad)

    def interrupted() -> Iterator[tuple[int, torch.Tensor]]:
        yield 0, y[:5]
        raise ConnectionError("stream broken")

    with pytest.raises(ConnectionError):
        server.add_masked(a, interrupted())
    assert server.survivors == ()
    with pytest.raises(SecAggError, match=r"unmask_request in stage mask"):
        server.unmask_request(a)
    for s in names:
        server.add_masked(s, pieces(masked[s], 3))
    with pytest.raises(SecAggError, match=r"already sent masked input"):
        server.add_masked(a, [(0, y)])
    server.close_masked()
    with pytest.raises(SecAggError, match=r"add_masked in stage unmask"):
        server.add_masked(a, [(0, y)])
    assert server.missing() == {f"b:{s}": 2 for s in names}
    surv, drop = server.unmask_request(a)
    assert surv == [b, c, d] and drop == []
    good = sites[a].reveal(surv, drop)
    with pytest.raises(SecAggError, match=r"cover exactly its live neighbours"):
        server.post_reveal(a, {b: good[b]})
    with pytest.raises(SecAggError, match=r"expected a b-share"):
        server.post_reveal(a, {**good, b: bytes([REVEAL_S]) + good[b][1:]})
    shifted = good[b][:1] + (int.from_bytes(good[b][1:5], "big") + 1).to_bytes(4, "big")
    with pytest.raises(SecAggError, match=r"has x=2, expected 1"):
        server.post_reveal(a, {**good, b: shifted + good[b][5:]})
    with pytest.raises(SecAggError, match=r"finish in stage unmask|cannot unmask"):
        server.finish()
    server.post_reveal(a, good)
    with pytest.raises(SecAggError, match=r"already revealed"):
        server.post_reveal(a, good)
    for s in (b, c):
        server.post_reveal(s, sites[s].reveal(*server.unmask_request(s)))
    assert server.missing() == {}
    result, count = server.finish()
    assert count == 4
    expected = quantise(torch.linspace(-1, 1, 10), CLIP, quant_bits(4)) * len(names)
    assert server.quantised_sum is not None and torch.equal(server.quantised_sum, expected)
    assert torch.allclose(result, 4 * torch.linspace(-1, 1, 10), atol=1e-6)
    with pytest.raises(SecAggError, match=r"finish in stage done"):
        server.finish()


def test_corrupted_revealed_shares_fail_loudly() -> None:
    names = ids(5)
    plan = plan_round(names, seed=b"c")  # k = 4, t = 2
    context = b"ctx-corrupt"
    sites = {s: SiteSecAgg(s, plan.threshold, context) for s in names}
    server = ServerSecAgg(plan, context, 32, clip=CLIP, bits=8)
    for s in names:
        server.advertise(s, sites[s].public_keys())
    server.close_advertise()
    for s in names:
        server.post_shares(s, sites[s].share_keys(server.neighbour_keys(s)))
    server.close_shares()
    gone = names[2]
    for s in names:
        if s != gone:
            sites[s].receive_shares(server.inbox(s))
            server.add_masked(s, [(0, sites[s].mask(torch.zeros(32), clip=CLIP, bits=8))])
    server.close_masked()
    assert server.dropped == (gone,)
    for s in server.survivors:
        revealed = sites[s].reveal(*server.unmask_request(s))
        share = revealed[gone]
        assert share[0] == REVEAL_S
        y = int.from_bytes(share[5:], "big")
        revealed[gone] = share[:5] + ((y + 1) % ((1 << 521) - 1)).to_bytes(66, "big")
        server.post_reveal(s, revealed)
    with pytest.raises(SecAggError, match=rf"cannot unmask: s:{gone}"):
        server.finish()
    assert server.stage == "unmask"


def test_concurrent_uploads_sum_correctly() -> None:
    import threading

    names = ids(6)
    plan = plan_round(names, seed=b"t")
    context = b"ctx-threads"
    length = 5000
    bits = quant_bits(6)
    sites = {s: SiteSecAgg(s, plan.threshold, context) for s in names}
    server = ServerSecAgg(plan, context, length, clip=CLIP, bits=bits)
    for s in names:
        server.advertise(s, sites[s].public_keys())
    server.close_advertise()
    for s in names:
        server.post_shares(s, sites[s].share_keys(server.neighbour_keys(s)))
    server.close_shares()
    inputs = {s: torch.linspace(-1, 1, length) * (i + 1) / 6 for i, s in enumerate(names)}
    masked = {}
    for s in names:
        sites[s].receive_shares(server.inbox(s))
        masked[s] = sites[s].mask(inputs[s], clip=CLIP, bits=bits)
    errors: list[BaseException] = []

    def upload(s: str) -> None:
        try:
            server.add_masked(s, pieces(masked[s], 97))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=upload, args=(s,)) for s in names]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    server.close_masked()
    for s in names:
        server.post_reveal(s, sites[s].reveal(*server.unmask_request(s)))
    server.finish()
    expected = torch.stack([quantise(inputs[s], CLIP, bits) for s in names]).sum(0)
    assert server.quantised_sum is not None and torch.equal(server.quantised_sum, expected)


def test_low_order_public_key_rejected() -> None:
    site = SiteSecAgg("a", 1, b"ctx")
    with pytest.raises(SecAggError, match=r"key agreement between 'a' and 'b' failed"):
        site.share_keys({"b": bytes(PUBLIC_KEYS_LEN)})
    peer = SiteSecAgg("b", 1, b"ctx")
    assert len(site.share_keys({"b": peer.public_keys()})) == 1  # the refusal changed nothing


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 40])
@pytest.mark.parametrize("degree", [0, 1, 2, 3, 4, 7, 12, 50])
@pytest.mark.parametrize("threshold", [0.01, 0.5, 0.75, 1.0])
def test_share_threshold_matches_the_plan(n: int, degree: int, threshold: float) -> None:
    """What a run spec is validated with equals what a round is planned with."""
    plan = plan_round(ids(n), degree=degree, threshold=threshold, seed=b"t")
    assert share_threshold(n, degree, threshold) == plan.threshold
