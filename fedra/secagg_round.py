"""What a site is told about its round's secure aggregation, as one typed record.

Apart from ``fedra.secagg`` so that holding one loads neither torch nor cryptography (the
admin CLI reads ``fedra.protos.serde``, which converts it to and from ``site.SecAggRound``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SecAggRound:
    """What a site is told about its round's secure aggregation (a Task's SecAggRound)."""

    context: bytes  # binds keys and shares to one run, round and attempt
    threshold: int  # shares that rebuild one site's secrets
    clip: float  # each coordinate is clipped to [-clip, clip] before quantising
    bits: int  # quantisation bits per coordinate
    l2_clip: float = 0.0  # > 0 with [privacy]: the site clips its whole update first
    noise_std: float = 0.0  # > 0 with [privacy]: its share of the Gaussian noise
