"""Secure aggregation (SecAgg+): the coordinator learns only the sum of the sites' updates.

SecAgg+ (Bell, Bonawitz, Gascon, Lepoint, Raykova, CCS 2020; after Bonawitz et al., CCS 2017)
for one round attempt, bound to a ``context`` byte string, on a neighbour graph (``plan_round``):

1. Advertise: each site makes two X25519 key pairs, c (share encryption) and s (mask seeds),
   and sends ``c_pk || s_pk``; the coordinator hands each site its neighbours' keys.
2. Share: each site draws a self-mask seed b and splits b and its s private key t-of-k (Shamir)
   among its neighbours, each share sealed for its recipient (X25519 + HKDF + AES-GCM).
3. Mask: each site adds to its quantised update PRG(b) and, for every neighbour v that shared,
   +/-PRG(seed_uv) with seed_uv agreed on the s keys, all mod 2**32; the coordinator folds the
   masked vectors into one running sum.
4. Unmask: each surviving site reveals, per live neighbour, the b-share if that neighbour sent
   masked input, else the s-share; the coordinator rebuilds those secrets, strips the self masks
   of the survivors and the pairwise masks towards dropped sites, and dequantises the sum.

Threat model: an honest-but-curious coordinator that may also see up to t - 1 shares of any
site through colluding neighbours. Pairwise masks hide each input; self masks hide the input of
a site wrongly declared dropped, because a site never reveals both its b-share and its s-share
for one peer (enforced with state), and sums of fewer than ``threshold + 1`` sites are refused.
Not covered: an actively malicious coordinator (no signed consistency round), bad inputs, DoS.
Every message is ``bytes`` or a ``str -> bytes`` dict, so any transport can carry them.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import sys
import threading
from bisect import bisect_left
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "MODULUS",
    "MODULUS_BITS",
    "PRIME",
    "PUBLIC_KEYS_LEN",
    "REVEAL_B",
    "REVEAL_S",
    "SHARE_LEN",
    "RoundPlan",
    "SecAggError",
    "ServerSecAgg",
    "SiteSecAgg",
    "dequantise_sum",
    "plan_round",
    "prg",
    "quant_bits",
    "quantise",
    "shamir_combine",
    "shamir_split",
]

MODULUS_BITS = 32
MODULUS = 1 << MODULUS_BITS
MASK = MODULUS - 1
PRIME = (1 << 521) - 1
SECRET_LEN = 32
KEY_LEN = 32
PUBLIC_KEYS_LEN = 2 * KEY_LEN
SHARE_LEN = 4 + 66  # x: uint32, y: 521-bit field element, both big-endian
NONCE_LEN = 12
TAG_LEN = 16
REVEAL_B = 1  # tag byte: a share of the peer's self-mask seed b (the peer survived)
REVEAL_S = 2  # tag byte: a share of the peer's s private key (the peer dropped)
SHARE_KEY_LABEL = b"fedra-secagg share-key"
MASK_SEED_LABEL = b"fedra-secagg mask-seed"

_X_LEN = 4
_Y_LEN = SHARE_LEN - _X_LEN
_CHUNK = 1 << 20
_REDUCE_EVERY = 64
_LITTLE_ENDIAN = sys.byteorder == "little"
_STAGES = ("advertise", "share", "mask", "unmask", "done")


class SecAggError(ValueError):
    """A secure-aggregation misuse or protocol violation; the object's state is unchanged."""


# --------------------------------------------------------------------------- primitives


def _lp(data: bytes) -> bytes:
    """``data`` with a 4-byte big-endian length prefix."""
    return len(data).to_bytes(4, "big") + data


def _info(label: bytes, context: bytes, a: str, b: str) -> bytes:
    """HKDF info binding a key to one round attempt and one unordered pair of sites."""
    lo, hi = sorted((a, b))
    return label + _lp(context) + _lp(lo.encode()) + _lp(hi.encode())


def _agree(
    private: X25519PrivateKey, peer_public: bytes, label: bytes, context: bytes, a: str, b: str
) -> bytes:
    """X25519 between ``private`` and ``peer_public``, then HKDF-SHA256 to 32 bytes."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:
        raise SecAggError(f"key agreement between {a!r} and {b!r} failed: {exc}") from exc
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_info(label, context, a, b))
    return hkdf.derive(shared)


def _seal(key: bytes, context: bytes, plaintext: bytes) -> bytes:
    """AES-256-GCM with a random nonce and ``context`` as AAD: ``nonce || ct``."""
    nonce = os.urandom(NONCE_LEN)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, context)


def _open(key: bytes, context: bytes, sealed: bytes) -> bytes:
    """Inverse of ``_seal``; raises ``InvalidTag`` on any tampering or wrong key/context."""
    if len(sealed) < NONCE_LEN + TAG_LEN:
        raise InvalidTag
    return AESGCM(key).decrypt(sealed[:NONCE_LEN], sealed[NONCE_LEN:], context)


def _share_plaintext(sender: str, recipient: str, b_share: bytes, s_share: bytes) -> bytes:
    return _lp(sender.encode()) + _lp(recipient.encode()) + b_share + s_share


def _sealed_len(sender: str, recipient: str) -> int:
    """Exact length of the sealed share message from ``sender`` to ``recipient``."""
    return NONCE_LEN + TAG_LEN + 8 + len(sender.encode()) + len(recipient.encode()) + 2 * SHARE_LEN


def _parse_share_plaintext(data: bytes) -> tuple[str, str, bytes, bytes]:
    """(sender, recipient, b-share, s-share) from a decrypted share message."""
    pos = 0
    names: list[str] = []
    for _ in range(2):
        if len(data) < pos + 4:
            raise ValueError("truncated")
        size = int.from_bytes(data[pos : pos + 4], "big")
        pos += 4
        if len(data) < pos + size:
            raise ValueError("truncated")
        names.append(data[pos : pos + size].decode())
        pos += size
    if len(data) != pos + 2 * SHARE_LEN:
        raise ValueError("wrong length")
    return names[0], names[1], data[pos : pos + SHARE_LEN], data[pos + SHARE_LEN :]


def prg(seed: bytes, offset: int, n: int) -> torch.Tensor:
    """Elements ``[offset, offset + n)`` of the mask stream of ``seed``: int64 in [0, 2**32).

    The stream is AES-256-CTR keyed by the 32-byte seed from a zero counter block, read as
    little-endian uint32; the counter is set to ``offset // 4`` so no prefix is generated.
    """
    if not isinstance(seed, bytes) or len(seed) != KEY_LEN:
        raise SecAggError(f"PRG seed must be {KEY_LEN} bytes")
    if offset < 0 or n < 0:
        raise SecAggError(f"PRG range [{offset}, {offset} + {n}) is negative")
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    block, skip = divmod(offset, 4)
    blocks = (skip + n + 3) // 4
    if block + blocks > 1 << 128:
        raise SecAggError("PRG range exceeds the AES-CTR counter space")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(block.to_bytes(16, "big"))).encryptor()
    stream = bytearray(blocks * 16 + 15)
    encryptor.update_into(bytes(blocks * 16), stream)
    if _LITTLE_ENDIAN:
        words = torch.frombuffer(stream, dtype=torch.int32, count=n, offset=4 * skip)
        return words.to(torch.int64).bitwise_and_(MASK)
    raw = torch.frombuffer(stream, dtype=torch.uint8, count=4 * n, offset=4 * skip)
    b = raw.view(n, 4).to(torch.int64)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


# --------------------------------------------------------------------------- Shamir


def _random_field_element() -> int:
    """Uniform in [0, PRIME) from os.urandom (rejection sampling on 521 bits)."""
    while True:
        value = int.from_bytes(os.urandom(_Y_LEN), "big") & PRIME
        if value != PRIME:
            return value


def _encode_share(x: int, y: int) -> bytes:
    return x.to_bytes(_X_LEN, "big") + y.to_bytes(_Y_LEN, "big")


def _decode_share(data: bytes) -> tuple[int, int]:
    """(x, y) from a serialised share; SecAggError if malformed."""
    if not isinstance(data, bytes) or len(data) != SHARE_LEN:
        raise SecAggError(f"a share must be {SHARE_LEN} bytes")
    x = int.from_bytes(data[:_X_LEN], "big")
    y = int.from_bytes(data[_X_LEN:], "big")
    if x == 0 or y >= PRIME:
        raise SecAggError("malformed share (x = 0 or y outside the field)")
    return x, y


def shamir_split(secret: bytes, t: int, k: int) -> list[bytes]:
    """Split a 32-byte secret into ``k`` shares (x = 1..k) of which any ``t`` rebuild it."""
    if not isinstance(secret, bytes) or len(secret) != SECRET_LEN:
        raise SecAggError(f"a secret must be {SECRET_LEN} bytes")
    if not 1 <= t <= k < 1 << (8 * _X_LEN):
        raise SecAggError(f"need 1 <= t <= k for a t-of-k split, got t={t}, k={k}")
    coeffs = [int.from_bytes(secret, "big")] + [_random_field_element() for _ in range(t - 1)]
    shares: list[bytes] = []
    for x in range(1, k + 1):
        y = 0
        for c in reversed(coeffs):
            y = (y * x + c) % PRIME
        shares.append(_encode_share(x, y))
    return shares


def _interpolate_at_zero(points: Sequence[tuple[int, int]]) -> int:
    """Lagrange interpolation at 0 over GF(PRIME) through distinct-x ``points``."""
    total = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    return total


def shamir_combine(shares: Iterable[bytes], t: int) -> bytes:
    """Rebuild a secret from at least ``t`` distinct shares (the first ``t`` by x are used)."""
    points: dict[int, int] = {}
    for share in shares:
        x, y = _decode_share(share)
        if points.setdefault(x, y) != y:
            raise SecAggError(f"two different shares for x={x}")
    if t < 1 or len(points) < t:
        raise SecAggError(f"need {t} distinct shares to rebuild a secret, got {len(points)}")
    value = _interpolate_at_zero(sorted(points.items())[:t])
    if value >> (8 * SECRET_LEN):
        raise SecAggError("shares are inconsistent: the rebuilt value is not a 32-byte secret")
    return value.to_bytes(SECRET_LEN, "big")


# --------------------------------------------------------------------------- quantisation


def quant_bits(n_sites: int) -> int:
    """Bits per coordinate so that a sum of ``n_sites`` values stays below 2**32."""
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
        raise SecAggError(f"n_sites must be a positive int, got {n_sites!r}")
    bits = MODULUS_BITS - n_sites.bit_length()  # bit_length(n) == ceil(log2(n + 1))
    if bits < 8:
        raise SecAggError(f"{n_sites} sites leave {bits} bits per coordinate (minimum 8)")
    return bits


def _check_quant(clip: float, bits: int) -> None:
    if not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0:
        raise SecAggError(f"clip must be a positive finite number, got {clip!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MODULUS_BITS:
        raise SecAggError(f"bits must be an int in [1, {MODULUS_BITS}], got {bits!r}")


def quantise(x: torch.Tensor, clip: float, bits: int) -> torch.Tensor:
    """Clamp to [-clip, clip] and map linearly onto the integers [0, 2**bits - 1] (int64)."""
    _check_quant(clip, bits)
    if not x.is_floating_point():
        raise SecAggError(f"quantise needs a floating-point tensor, got {x.dtype}")
    xd = x.detach().to(device="cpu", dtype=torch.float64)
    if torch.isnan(xd).any():
        raise SecAggError("cannot quantise NaN values")
    levels = (1 << bits) - 1
    q = torch.round((xd.clamp(-clip, clip) + clip) * (levels / (2 * clip)))
    return q.clamp_(0, levels).to(torch.int64)


def dequantise_sum(total: torch.Tensor, n: int, clip: float, bits: int) -> torch.Tensor:
    """The float32 sum of ``n`` dequantised values whose quantised sum is ``total``."""
    _check_quant(clip, bits)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise SecAggError(f"n must be a non-negative int, got {n!r}")
    levels = (1 << bits) - 1
    out = total.detach().to(device="cpu", dtype=torch.float64) * (2 * clip / levels) - n * clip
    return out.to(torch.float32)


# --------------------------------------------------------------------------- round plan


@dataclass(frozen=True)
class RoundPlan:
    """Who takes part, who shares with whom, and how many shares rebuild a secret."""

    participants: tuple[str, ...]
    neighbours: dict[str, tuple[str, ...]]
    threshold: int


def share_threshold(n: int, degree: int, threshold: float) -> int:
    """t for ``n`` participants, as ``plan_round`` computes it, without building the graph:
    each site has k = n - 1 neighbours (complete graph) or k = degree rounded up to even."""
    even = degree + (degree & 1)
    k = n - 1 if degree == 0 or even >= n - 1 else even
    return max(1, math.ceil(Fraction(threshold) * k))


def plan_round(
    participants: Sequence[str], *, degree: int = 0, threshold: float = 0.5, seed: bytes
) -> RoundPlan:
    """The neighbour graph and share threshold of one round.

    ``degree`` 0 or >= n - 1 gives the complete graph (classic SecAgg); otherwise a ring of the
    participants shuffled by HMAC-SHA256(seed, id), each joined to the ``degree // 2`` nearest on
    both sides (odd degrees round up). ``threshold`` is the fraction of the smallest
    neighbourhood whose shares rebuild a secret.
    """
    if isinstance(participants, (str, bytes)):
        raise SecAggError("participants must be a sequence of site ids, not a string")
    ids = list(participants)
    for site in ids:
        if not isinstance(site, str) or not site:
            raise SecAggError(f"site id {site!r} must be a non-empty str")
    if len(set(ids)) != len(ids):
        dupes = sorted({s for s in ids if ids.count(s) > 1})
        raise SecAggError(f"participants are not unique: {dupes}")
    n = len(ids)
    if n < 2:
        raise SecAggError(f"secure aggregation needs at least 2 participants, got {n}")
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 0:
        raise SecAggError(f"degree must be a non-negative int, got {degree!r}")
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not math.isfinite(threshold)
        or not 0 < threshold <= 1
    ):
        raise SecAggError(f"threshold must be a fraction in (0, 1], got {threshold!r}")
    if not isinstance(seed, bytes) or not seed:
        raise SecAggError("seed must be non-empty bytes")
    ordered = sorted(ids)
    even = degree + (degree & 1)
    links: dict[str, set[str]] = {site: set() for site in ordered}
    if degree == 0 or even >= n - 1:
        for site in ordered:
            links[site] = set(ordered) - {site}
    else:
        ring = sorted(ordered, key=lambda s: hmac.new(seed, s.encode(), hashlib.sha256).digest())
        for i, site in enumerate(ring):
            for step in range(1, even // 2 + 1):
                other = ring[(i + step) % n]
                links[site].add(other)
                links[other].add(site)
    neighbours = {site: tuple(sorted(links[site])) for site in ordered}
    k = min(len(v) for v in neighbours.values())
    t = max(1, math.ceil(Fraction(threshold) * k))
    return RoundPlan(participants=tuple(ordered), neighbours=neighbours, threshold=t)


# --------------------------------------------------------------------------- site side


def _check_context(context: bytes) -> bytes:
    if not isinstance(context, bytes) or not context:
        raise SecAggError("context must be non-empty bytes (unique per round attempt)")
    return context


class SiteSecAgg:
    """One site's side of one round attempt: keys, shares, masking and the guarded reveal."""

    def __init__(self, site_id: str, plan_threshold: int, context: bytes) -> None:
        if not isinstance(site_id, str) or not site_id:
            raise SecAggError(f"site id {site_id!r} must be a non-empty str")
        if isinstance(plan_threshold, bool) or not isinstance(plan_threshold, int):
            raise SecAggError(f"site {site_id!r}: threshold must be an int")
        if plan_threshold < 1:
            raise SecAggError(f"site {site_id!r}: threshold must be >= 1, got {plan_threshold}")
        self._id = site_id
        self._t = plan_threshold
        self._context = _check_context(context)
        self._c_sk = X25519PrivateKey.generate()
        self._s_sk = X25519PrivateKey.generate()
        self._lock = threading.Lock()
        self._stage = "keys"  # -> shared -> received -> masked
        self._share_keys: dict[str, bytes] = {}
        self._seeds: dict[str, bytes] = {}
        self._b = b""
        self._held: dict[str, tuple[bytes, bytes]] = {}  # sender -> (b-share, s-share)
        self._live: tuple[str, ...] = ()
        self._reveal_sets: tuple[frozenset[str], frozenset[str]] | None = None
        self._revealed: dict[str, bytes] = {}

    @property
    def site_id(self) -> str:
        """This site's id."""
        return self._id

    @property
    def live_neighbours(self) -> tuple[str, ...]:
        """Neighbours whose shares arrived (the pairwise masks' peers), sorted."""
        return self._live

    def public_keys(self) -> bytes:
        """``c_pk || s_pk``, 64 bytes of raw X25519 public keys."""
        return (
            self._c_sk.public_key().public_bytes_raw() + self._s_sk.public_key().public_bytes_raw()
        )

    def _fail(self, what: str) -> SecAggError:
        return SecAggError(f"site {self._id!r}: {what}")

    def share_keys(self, neighbour_keys: Mapping[str, bytes]) -> dict[str, bytes]:
        """Stage 2: split b and the s private key t-of-k among the neighbours, sealed for each."""
        with self._lock:
            if self._stage != "keys":
                raise self._fail("share_keys was already called")
            if not isinstance(neighbour_keys, Mapping):
                raise self._fail("neighbour_keys must be a mapping of site id -> 64 bytes")
            share_keys: dict[str, bytes] = {}
            seeds: dict[str, bytes] = {}
            for peer, keys in neighbour_keys.items():
                if not isinstance(peer, str) or not peer:
                    raise self._fail(f"neighbour id {peer!r} must be a non-empty str")
                if peer == self._id:
                    raise self._fail("its own keys are among its neighbours' keys")
                if not isinstance(keys, bytes) or len(keys) != PUBLIC_KEYS_LEN:
                    raise self._fail(f"public keys of {peer!r} must be {PUBLIC_KEYS_LEN} bytes")
                share_keys[peer] = _agree(
                    self._c_sk, keys[:KEY_LEN], SHARE_KEY_LABEL, self._context, self._id, peer
                )
                seeds[peer] = _agree(
                    self._s_sk, keys[KEY_LEN:], MASK_SEED_LABEL, self._context, self._id, peer
                )
            peers = sorted(share_keys)
            if len(peers) < self._t:
                raise self._fail(f"{len(peers)} neighbours advertised keys, need {self._t}")
            b = os.urandom(SECRET_LEN)
            b_shares = shamir_split(b, self._t, len(peers))
            s_shares = shamir_split(self._s_sk.private_bytes_raw(), self._t, len(peers))
            out = {
                peer: _seal(
                    share_keys[peer],
                    self._context,
                    _share_plaintext(self._id, peer, b_shares[i], s_shares[i]),
                )
                for i, peer in enumerate(peers)
            }
            self._share_keys, self._seeds, self._b = share_keys, seeds, b
            self._stage = "shared"
            return out

    def receive_shares(self, inbox: Mapping[str, bytes]) -> None:
        """Stage 3 input: open the neighbours' sealed shares; the senders become live."""
        with self._lock:
            if self._stage != "shared":
                raise self._fail(
                    "receive_shares needs share_keys first"
                    if self._stage == "keys"
                    else "receive_shares was already called"
                )
            if not isinstance(inbox, Mapping):
                raise self._fail("inbox must be a mapping of sender -> ciphertext")
            held: dict[str, tuple[bytes, bytes]] = {}
            for sender, sealed in inbox.items():
                if sender not in self._share_keys:
                    raise self._fail(f"share from unknown sender {sender!r}")
                if not isinstance(sealed, bytes):
                    raise self._fail(f"ciphertext from {sender!r} must be bytes")
                try:
                    plain = _open(self._share_keys[sender], self._context, sealed)
                    claimed_from, claimed_to, b_share, s_share = _parse_share_plaintext(plain)
                except (InvalidTag, ValueError) as exc:
                    raise self._fail(f"share from {sender!r} does not decrypt or parse") from exc
                if claimed_from != sender or claimed_to != self._id:
                    raise self._fail(
                        f"share from {sender!r} is addressed {claimed_from!r} -> {claimed_to!r}"
                    )
                try:
                    xb, _ = _decode_share(b_share)
                    xs, _ = _decode_share(s_share)
                except SecAggError as exc:
                    raise self._fail(f"share from {sender!r} is malformed: {exc}") from exc
                if xb != xs:
                    raise self._fail(f"share from {sender!r} mixes x-coordinates {xb}, {xs}")
                held[sender] = (b_share, s_share)
            if len(held) < self._t:
                raise self._fail(f"shares from {len(held)} neighbours, need {self._t}")
            self._held = held
            self._live = tuple(sorted(held))
            self._stage = "received"

    def mask(self, values: torch.Tensor, *, clip: float, bits: int) -> torch.Tensor:
        """Stage 3: the masked quantised update, int64 in [0, 2**32), same length as ``values``."""
        with self._lock:
            if self._stage != "received":
                raise self._fail(
                    "mask was already called"
                    if self._stage == "masked"
                    else "mask needs receive_shares first"
                )
            if not isinstance(values, torch.Tensor) or values.dim() != 1 or not values.numel():
                raise self._fail("values must be a non-empty 1-D tensor")
            _check_quant(clip, bits)
            length = values.numel()
            out = torch.empty(length, dtype=torch.int64)
            for off in range(0, length, _CHUNK):
                n = min(_CHUNK, length - off)
                acc = quantise(values[off : off + n], clip, bits)
                acc += prg(self._b, off, n)
                for i, peer in enumerate(self._live):
                    if self._id < peer:
                        acc += prg(self._seeds[peer], off, n)
                    else:
                        acc -= prg(self._seeds[peer], off, n)
                    if i % _REDUCE_EVERY == _REDUCE_EVERY - 1:
                        acc.bitwise_and_(MASK)
                out[off : off + n] = acc.bitwise_and_(MASK)
            self._stage = "masked"
            return out

    def reveal(self, survivors: Collection[str], dropped: Collection[str]) -> dict[str, bytes]:
        """Stage 4: b-shares of surviving peers, s-shares of dropped ones (tagged), once.

        Refuses (revealing nothing) a peer named in both sets, a name that is not a live
        neighbour, fewer than t survivors counting this site, or a second, different request.
        """
        with self._lock:
            if self._stage != "masked":
                raise self._fail("reveal needs mask first")
            if isinstance(survivors, (str, bytes)) or isinstance(dropped, (str, bytes)):
                raise self._fail("survivors and dropped must be collections, not strings")
            try:
                surv = frozenset(survivors)
                drop = frozenset(dropped)
            except TypeError as exc:
                raise self._fail("survivors and dropped must be collections of site ids") from exc
            if self._reveal_sets is not None:
                if (surv, drop) != self._reveal_sets:
                    raise self._fail("refusing a second reveal with a different survivor set")
                return dict(self._revealed)
            both = surv & drop
            if both:
                raise self._fail(f"refusing to reveal: {sorted(both)} named survivor and dropped")
            unknown = (surv | drop) - set(self._live)
            if unknown:
                raise self._fail(f"refusing to reveal: {sorted(unknown)} are not live neighbours")
            if len(surv) + 1 < self._t:
                raise self._fail(
                    f"refusing to reveal: {len(surv) + 1} survivors (counting itself), "
                    f"need {self._t}"
                )
            out: dict[str, bytes] = {}
            for peer in sorted(surv):
                out[peer] = bytes([REVEAL_B]) + self._held[peer][0]
            for peer in sorted(drop):
                out[peer] = bytes([REVEAL_S]) + self._held[peer][1]
            self._reveal_sets = (surv, drop)
            self._revealed = out
            return dict(out)


# --------------------------------------------------------------------------- coordinator side


def _rebuild(name: str, shares: Mapping[str, bytes], t: int) -> bytes:
    """Combine the revealed shares of one secret, naming it in any error."""
    try:
        return shamir_combine(shares.values(), t)
    except SecAggError as exc:
        raise SecAggError(f"cannot unmask: {name}: {exc}") from exc


class ServerSecAgg:
    """The coordinator's side of one round attempt; thread-safe.

    Each ``close_*`` refuses (and leaves the stage open) while fewer than ``threshold + 1``
    sites are still in, since such a round could not be unmasked anyway. ``add_masked`` calls
    are serialised: each stages one site's pieces in a single scratch vector so that a failed
    or interrupted upload leaves the running sum untouched.
    """

    def __init__(
        self, plan: RoundPlan, context: bytes, length: int, *, clip: float, bits: int
    ) -> None:
        if not isinstance(plan, RoundPlan):
            raise SecAggError("plan must be a RoundPlan")
        if len(plan.participants) < 2 or set(plan.neighbours) != set(plan.participants):
            raise SecAggError("plan is inconsistent: participants and neighbours differ")
        if not 1 <= plan.threshold <= min(len(v) for v in plan.neighbours.values()):
            raise SecAggError(f"plan threshold {plan.threshold} exceeds a neighbourhood size")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise SecAggError(f"length must be a positive int, got {length!r}")
        _check_quant(clip, bits)
        n = len(plan.participants)
        if n * ((1 << bits) - 1) >= MODULUS:
            raise SecAggError(
                f"{bits} bits per coordinate overflow 2**{MODULUS_BITS} for {n} sites; "
                f"use quant_bits({n}) = {quant_bits(n)} or fewer"
            )
        self.plan = plan
        self.context = _check_context(context)
        self.length = length
        self.clip = clip
        self.bits = bits
        self._lock = threading.Lock()
        self._upload_lock = threading.Lock()
        self._stage = 0
        self._keys: dict[str, bytes] = {}
        self._posted: dict[str, dict[str, bytes]] = {}
        self._received: set[str] = set()
        self._uploading: set[str] = set()
        self._sum: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._revealed: set[str] = set()
        self._b_shares: dict[str, dict[str, bytes]] = {}  # owner -> holder -> share
        self._s_shares: dict[str, dict[str, bytes]] = {}
        self._total: torch.Tensor | None = None

    # ----------------------------------------------------------------- status

    @property
    def stage(self) -> str:
        """One of advertise, share, mask, unmask, done."""
        return _STAGES[self._stage]

    @property
    def survivors(self) -> tuple[str, ...]:
        """Sites whose masked input has been folded into the sum, sorted."""
        with self._lock:
            return tuple(sorted(self._received))

    @property
    def dropped(self) -> tuple[str, ...]:
        """Participants that missed a closed stage, sorted."""
        with self._lock:
            if self._stage == 0:
                return ()
            alive: Collection[str] = (self._keys, self._posted, self._received)[
                min(self._stage, 3) - 1
            ]
            return tuple(s for s in self.plan.participants if s not in alive)

    @property
    def quantised_sum(self) -> torch.Tensor | None:
        """After ``finish``: the unmasked int64 sum of the survivors' quantised updates."""
        return self._total

    # ----------------------------------------------------------------- helpers

    def _fail(self, site: str, what: str) -> SecAggError:
        return SecAggError(f"site {site!r}: {what}")

    def _need_stage(self, site: str, action: str, *stages: int) -> None:
        if self._stage not in stages:
            wanted = " or ".join(_STAGES[s] for s in stages)
            raise self._fail(site, f"{action} in stage {self.stage} (needs {wanted})")

    def _need_participant(self, site: str) -> None:
        if not isinstance(site, str) or site not in self.plan.neighbours:
            raise SecAggError(f"site {site!r}: not a participant of this round")

    def _advertised_neighbours(self, site: str) -> list[str]:
        return [v for v in self.plan.neighbours[site] if v in self._keys]

    def _live(self, site: str) -> list[str]:
        return [v for v in self.plan.neighbours[site] if v in self._posted]

    def _need_s(self) -> list[str]:
        """Dropped sites with a surviving neighbour: their s keys must be rebuilt."""
        return [
            d
            for d in self.plan.participants
            if d in self._posted
            and d not in self._received
            and any(v in self._received for v in self.plan.neighbours[d])
        ]

    def _short(self) -> dict[str, tuple[int, int]]:
        """Secret -> (shares held, shares needed) for each secret still short of t."""
        t = self.plan.threshold
        short: dict[str, tuple[int, int]] = {}
        for u in sorted(self._received):
            have = len(self._b_shares.get(u, {}))
            if have < t:
                short[f"b:{u}"] = (have, t)
        for d in self._need_s():
            have = len(self._s_shares.get(d, {}))
            if have < t:
                short[f"s:{d}"] = (have, t)
        return short

    def _need_quorum(self, alive: int, what: str) -> None:
        need = self.plan.threshold + 1
        if alive < need:
            raise SecAggError(
                f"only {alive} sites {what}, need at least {need} (threshold + 1): abort the round"
            )

    # ----------------------------------------------------------------- stage 1

    def advertise(self, site: str, keys: bytes) -> None:
        """Record a site's 64-byte public keys (the same bytes again is a no-op)."""
        with self._lock:
            self._need_participant(site)
            self._need_stage(site, "advertise", 0)
            if not isinstance(keys, bytes) or len(keys) != PUBLIC_KEYS_LEN:
                raise self._fail(site, f"public keys must be {PUBLIC_KEYS_LEN} bytes")
            old = self._keys.get(site)
            if old is not None and old != keys:
                raise self._fail(site, "already advertised different keys")
            self._keys[site] = keys

    def close_advertise(self) -> None:
        """No more keys; refused while fewer than threshold + 1 sites advertised."""
        with self._lock:
            if self._stage != 0:
                raise SecAggError(f"close_advertise in stage {self.stage}")
            self._need_quorum(len(self._keys), "advertised keys")
            self._stage = 1

    def neighbour_keys(self, site: str) -> dict[str, bytes]:
        """The public keys of the site's neighbours that advertised."""
        with self._lock:
            self._need_participant(site)
            self._need_stage(site, "neighbour_keys", 1, 2, 3, 4)
            if site not in self._keys:
                raise self._fail(site, "did not advertise keys")
            return {v: self._keys[v] for v in self._advertised_neighbours(site)}

    # ----------------------------------------------------------------- stage 2

    def post_shares(self, site: str, ciphertexts: Mapping[str, bytes]) -> None:
        """Record a site's sealed shares: exactly one per advertised neighbour, once."""
        with self._lock:
            self._need_participant(site)
            self._need_stage(site, "post_shares", 1)
            if site not in self._keys:
                raise self._fail(site, "posted shares without advertising keys")
            if site in self._posted:
                raise self._fail(site, "already posted shares")
            if not isinstance(ciphertexts, Mapping):
                raise self._fail(site, "ciphertexts must be a mapping of recipient -> bytes")
            expected = self._advertised_neighbours(site)
            if set(ciphertexts) != set(expected):
                extra = sorted(set(ciphertexts) - set(expected), key=str)
                lacking = sorted(set(expected) - set(ciphertexts))
                raise self._fail(
                    site,
                    f"shares must go to its advertised neighbours: extra {extra}, "
                    f"missing {lacking}",
                )
            if len(expected) < self.plan.threshold:
                raise self._fail(site, f"{len(expected)} neighbours < threshold")
            for v in expected:
                ct = ciphertexts[v]
                if not isinstance(ct, bytes) or len(ct) != _sealed_len(site, v):
                    raise self._fail(site, f"ciphertext for {v!r} has the wrong type or length")
            self._posted[site] = {v: ciphertexts[v] for v in expected}

    def close_shares(self) -> None:
        """No more shares; refused while fewer than threshold + 1 sites posted."""
        with self._lock:
            if self._stage != 1:
                raise SecAggError(f"close_shares in stage {self.stage}")
            self._need_quorum(len(self._posted), "posted shares")
            self._stage = 2

    def inbox(self, site: str) -> dict[str, bytes]:
        """The sealed shares addressed to a site that posted its own, by sender."""
        with self._lock:
            self._need_participant(site)
            self._need_stage(site, "inbox", 2, 3, 4)
            if site not in self._posted:
                raise self._fail(site, "did not post shares")
            return {v: self._posted[v][site] for v in self._live(site)}

    # ----------------------------------------------------------------- stage 3

    def add_masked(self, site: str, pieces: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Fold one site's masked vector, given as (offset, int64 chunk) pieces, into the sum.

        The pieces must cover [0, length) exactly once with values in [0, 2**32); anything else,
        or an exception from ``pieces`` itself, leaves the sum and the site's status unchanged.
        """
        with self._lock:
            self._need_participant(site)
            self._need_stage(site, "add_masked", 2)
            if site not in self._posted:
                raise self._fail(site, "sent masked input without posting shares")
            if site in self._received:
                raise self._fail(site, "already sent masked input")
            if site in self._uploading:
                raise self._fail(site, "is already uploading masked input")
            self._uploading.add(site)
        try:
            with self._upload_lock:
                if self._scratch is None:
                    self._scratch = torch.empty(self.length, dtype=torch.int64)
                self._stage_pieces(site, pieces, self._scratch)
                with self._lock:
                    if self._stage != 2:
                        raise self._fail(site, "masked input completed after close_masked")
                    if self._sum is None:
                        self._sum = self._scratch
                        self._scratch = None
                    else:
                        self._sum.add_(self._scratch).bitwise_and_(MASK)
                    self._received.add(site)
        finally:
            with self._lock:
                self._uploading.discard(site)

    def _stage_pieces(
        self, site: str, pieces: Iterable[tuple[int, torch.Tensor]], scratch: torch.Tensor
    ) -> None:
        """Copy validated pieces into ``scratch``; check they tile [0, length) exactly."""
        starts: list[int] = []
        ends: list[int] = []
        covered = 0
        for item in pieces:
            if not isinstance(item, tuple) or len(item) != 2:
                raise self._fail(site, "each piece must be an (offset, tensor) pair")
            offset, chunk = item
            if isinstance(offset, bool) or not isinstance(offset, int):
                raise self._fail(site, f"piece offset {offset!r} is not an int")
            if not isinstance(chunk, torch.Tensor) or chunk.dtype != torch.int64:
                raise self._fail(site, f"piece at {offset} must be an int64 tensor")
            if chunk.dim() != 1 or chunk.numel() == 0:
                raise self._fail(site, f"piece at {offset} must be a non-empty 1-D tensor")
            end = offset + chunk.numel()
            if offset < 0 or end > self.length:
                raise self._fail(site, f"piece [{offset}, {end}) is outside [0, {self.length})")
            i = bisect_left(starts, offset)
            if (i > 0 and ends[i - 1] > offset) or (i < len(starts) and starts[i] < end):
                raise self._fail(site, f"piece [{offset}, {end}) overlaps an earlier piece")
            chunk = chunk.detach().cpu()
            lo, hi = torch.aminmax(chunk)
            if int(lo) < 0 or int(hi) > MASK:
                raise self._fail(site, f"piece at {offset} has values outside [0, 2**32)")
            scratch[offset:end] = chunk
            starts.insert(i, offset)
            ends.insert(i, end)
            covered += end - offset
        if covered != self.length:
            raise self._fail(site, f"pieces cover {covered} of {self.length} elements")

    def close_masked(self) -> None:
        """No more masked input; refused while fewer than threshold + 1 sites sent theirs."""
        with self._lock:
            if self._stage != 2:
                raise SecAggError(f"close_masked in stage {self.stage}")
            self._need_quorum(len(self._received), "sent masked input")
            self._stage = 3
            self._scratch = None

    def unmask_request(self, site: str) -> tuple[list[str], list[str]]:
        """(survivors, dropped) among a surviving site's neighbours that posted shares."""
        with self._lock:
            self._need_participant(site)
            self._need_stage(site, "unmask_request", 3)
            if site not in self._received:
                raise self._fail(site, "sent no masked input, so it has nothing to unmask")
            live = self._live(site)
            return [v for v in live if v in self._received], [
                v for v in live if v not in self._received
            ]

    # ----------------------------------------------------------------- stage 4

    def post_reveal(self, site: str, revealed: Mapping[str, bytes]) -> None:
        """Record a surviving site's revealed shares: exactly those ``unmask_request`` named."""
        with self._lock:
            self._need_participant(site)
            self._need_stage(site, "post_reveal", 3)
            if site not in self._received:
                raise self._fail(site, "sent no masked input, so it cannot reveal")
            if site in self._revealed:
                raise self._fail(site, "already revealed")
            if not isinstance(revealed, Mapping):
                raise self._fail(site, "revealed must be a mapping of peer -> bytes")
            live = self._live(site)
            if set(revealed) != set(live):
                raise self._fail(site, "revealed shares must cover exactly its live neighbours")
            parsed: list[tuple[str, bool, bytes]] = []
            for peer in live:
                data = revealed[peer]
                if not isinstance(data, bytes) or len(data) != 1 + SHARE_LEN:
                    raise self._fail(site, f"revealed share for {peer!r} has the wrong length")
                survived = peer in self._received
                if data[0] != (REVEAL_B if survived else REVEAL_S):
                    kind = "b-share" if survived else "s-share"
                    raise self._fail(site, f"expected a {kind} for {peer!r}, got tag {data[0]}")
                share = data[1:]
                try:
                    x, _ = _decode_share(share)
                except SecAggError as exc:
                    raise self._fail(site, f"revealed share for {peer!r}: {exc}") from exc
                expected_x = 1 + self._advertised_neighbours(peer).index(site)
                if x != expected_x:
                    raise self._fail(site, f"share for {peer!r} has x={x}, expected {expected_x}")
                parsed.append((peer, survived, share))
            for peer, survived, share in parsed:
                store = self._b_shares if survived else self._s_shares
                store.setdefault(peer, {})[site] = share
            self._revealed.add(site)

    def missing(self) -> dict[str, int]:
        """For each secret still short of t shares ("b:<site>" / "s:<site>"): how many more."""
        with self._lock:
            if self._stage < 3:
                raise SecAggError(f"missing in stage {self.stage} (needs unmask)")
            return {name: need - have for name, (have, need) in self._short().items()}

    def finish(self, *, chunk: int = 1 << 20) -> tuple[torch.Tensor, int]:
        """Unmask the sum: (float32 sum of the survivors' dequantised updates, survivor count)."""
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise SecAggError(f"chunk must be a positive int, got {chunk!r}")
        with self._lock:
            if self._stage != 3:
                raise SecAggError(f"finish in stage {self.stage} (needs unmask)")
            self._need_quorum(len(self._received), "survived")
            short = self._short()
            if short:
                detail = ", ".join(f"{k} has {h} of {n} shares" for k, (h, n) in short.items())
                raise SecAggError(f"cannot unmask: {detail}")
            t = self.plan.threshold
            self_seeds = [_rebuild(f"b:{u}", self._b_shares[u], t) for u in sorted(self._received)]
            pair_seeds: list[tuple[int, bytes]] = []  # (sign the survivor used, seed)
            for d in self._need_s():
                s_sk = X25519PrivateKey.from_private_bytes(_rebuild(f"s:{d}", self._s_shares[d], t))
                if s_sk.public_key().public_bytes_raw() != self._keys[d][KEY_LEN:]:
                    raise SecAggError(f"cannot unmask: s:{d} rebuilt does not match its public key")
                for u in self.plan.neighbours[d]:
                    if u in self._received:
                        seed = _agree(
                            s_sk, self._keys[u][KEY_LEN:], MASK_SEED_LABEL, self.context, d, u
                        )
                        pair_seeds.append((1 if u < d else -1, seed))
            if self._sum is None:  # unreachable: close_masked saw threshold + 1 inputs
                raise SecAggError("no masked input was received")
            total = self._sum
            for off in range(0, self.length, chunk):
                n = min(chunk, self.length - off)
                acc = total[off : off + n]
                for i, seed in enumerate(self_seeds):
                    acc.sub_(prg(seed, off, n))
                    if i % _REDUCE_EVERY == _REDUCE_EVERY - 1:
                        acc.bitwise_and_(MASK)
                for i, (sign, seed) in enumerate(pair_seeds):
                    if sign > 0:
                        acc.sub_(prg(seed, off, n))
                    else:
                        acc.add_(prg(seed, off, n))
                    if i % _REDUCE_EVERY == _REDUCE_EVERY - 1:
                        acc.bitwise_and_(MASK)
                acc.bitwise_and_(MASK)
            self._total = total
            self._sum = None
            self._stage = 4
            count = len(self._received)
            return dequantise_sum(total, count, self.clip, self.bits), count
