"""Central differential privacy for DP-FedAvg at site level: clipping and secure Gaussian
noise.

Each round the coordinator clips every site's update to L2 norm ``clip``
(:func:`clip_factor`), sums them and adds Gaussian noise of standard deviation
``noise_multiplier * clip`` with :func:`add_secure_gaussian_`, as in DP-FedAvg (McMahan,
Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models", ICLR
2018), then divides by ``sites_per_round``. What a round costs, and what a run has spent,
is ``fedra.accounting``'s (Google's dp-accounting library, with the sampling the run declares).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

if TYPE_CHECKING:  # imported where used: run specs validate, and the CLI starts, without it
    import torch

__all__ = ["PrivacyError", "add_secure_gaussian_", "clip_factor"]


class PrivacyError(ValueError):
    """A privacy parameter or stored accountant state is invalid; the message names it."""


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PrivacyError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise PrivacyError(f"{name} must be finite, got {value!r}")
    return v


def _positive(name: str, value: float) -> float:
    v = _finite(name, value)
    if v <= 0:
        raise PrivacyError(f"{name} must be > 0, got {value!r}")
    return v


def clip_factor(norm: float, clip: float) -> float:
    """The factor ``min(1, clip / norm)`` that scales an update of L2 norm ``norm`` to at most
    ``clip`` (1.0 for a zero update). :class:`PrivacyError` for a ``clip`` that is not finite and
    > 0, or a ``norm`` that is not finite and >= 0 (a NaN or infinite update cannot be clipped)."""
    c = _positive("clip", clip)
    n = _finite("norm", norm)
    if n < 0:
        raise PrivacyError(f"norm must be >= 0, got {norm!r}")
    if n <= c:
        return 1.0
    return c / n


_MASK53 = (1 << 53) - 1
_TWO_M53 = 2.0**-53


def add_secure_gaussian_(tensor: torch.Tensor, std: float, *, chunk: int = 1 << 20) -> torch.Tensor:
    """Add N(0, ``std**2``) noise to every element of ``tensor`` in place and return it.

    The randomness is a ChaCha20 keystream (a CSPRNG) under a fresh ``os.urandom(32)`` key per
    chunk, never torch's or Python's statistical generators, whose state an observer could
    recover and subtract. Each element takes 64 keystream bits, of which 53 become a uniform:
    ``(k + 1) * 2**-53`` in (0, 1] for the Box-Muller radius (never 0, so the log is finite) and
    ``k * 2**-53`` in [0, 1) for its angle. Box-Muller runs in float64 and the noise is cast to
    the tensor's dtype (any floating dtype; float32 and float64 are the ones meant).

    Work goes ``chunk`` elements at a time, so the memory used beyond the tensor is O(chunk)
    (about 60 bytes per chunk element, some 60 MiB at the default), except that a
    non-contiguous tensor is noised through one contiguous copy that is copied back. A tensor on
    an accelerator receives noise drawn on the CPU. ``std`` must be finite and >= 0; 0 leaves the
    tensor untouched. :class:`PrivacyError` for a non-floating tensor or one
    whose elements share memory (an expanded view).
    """
    import torch  # noqa: PLC0415

    s = _finite("std", std)
    if s < 0:
        raise PrivacyError(f"std must be >= 0, got {std!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise PrivacyError(f"chunk must be an integer >= 1, got {chunk!r}")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise PrivacyError(f"tensor must be a floating-point tensor, got {what}")
    if any(st == 0 and sz > 1 for st, sz in zip(tensor.stride(), tensor.shape, strict=True)):
        raise PrivacyError("tensor must not have elements that share memory (an expanded view)")
    numel = tensor.numel()
    if s == 0 or numel == 0:
        return tensor
    with torch.no_grad():
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        pairs_max = (min(chunk, numel) + 1) // 2
        zeros = bytes(16 * pairs_max)
        buf = bytearray(16 * pairs_max)
        for start in range(0, numel, chunk):
            n = min(chunk, numel - start)
            pairs = (n + 1) // 2
            nbytes = 16 * pairs
            key = os.urandom(32)
            enc = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
            enc.update_into(memoryview(zeros)[:nbytes], memoryview(buf)[:nbytes])
            bits = torch.frombuffer(buf, dtype=torch.int64, count=2 * pairs)
            u = bits.bitwise_and_(_MASK53).to(torch.float64)
            radius = u[:pairs].add(1.0).mul_(_TWO_M53).log_().mul_(-2.0).sqrt_().mul_(s)
            theta = u[pairs:].mul_(2.0 * math.pi * _TWO_M53)
            noise = torch.cat((radius * torch.cos(theta), radius.mul_(torch.sin(theta))))
            flat[start : start + n].add_(noise[:n].to(device=flat.device, dtype=flat.dtype))
        if work is not tensor:
            tensor.copy_(work)
    return tensor
