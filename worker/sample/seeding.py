"""Seeded sampling keyed by position: the uniform for a seeded sequence's token is a pure function
of (request seed, sequence index, output position).

A sequence's draws therefore depend on nothing else: not on its batch-mates, not on how many
draws came before on this engine. A sequence continued on another replica (``core.resume``)
draws, from its first new token on, exactly what the uninterrupted one would have.

The key is splitmix64 (Steele, Lea and Flood 2014; the seeding mix of Java's SplittableRandom and
of xoshiro) applied as a chain: ``mix(mix(mix(seed) ^ index) ^ position)``, ``seed`` taken as its
64-bit two's complement. Each ``mix`` is a bijection of 64-bit words with full avalanche, so
neighbouring seeds, indices and positions give unrelated generators. The uniform itself comes from
torch's CPU generator (Mersenne Twister) seeded with that key: one generator, reseeded per draw
(a reseed costs less than a new generator; the figures are in docs/reliability.md).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One splitmix64 output for the state ``x`` (the state advanced by the golden-ratio step, then
    mixed): a bijection of 64-bit words."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_key(seed: int, index: int, position: int) -> int:
    """The 64-bit generator seed for the token at output ``position`` (0 for the first output
    token) of sequence ``index`` of a request seeded with ``seed``."""
    return splitmix64(splitmix64(splitmix64(seed & _MASK64) ^ index) ^ position)


class PositionKeyedDraws:
    """Uniforms in (0, 1] for seeded rows, each from the generator its (seed, index, position) keys."""

    def __init__(self) -> None:
        self._generator = torch.Generator()  # holds no state between draws: reseeded every time

    def uniform(self, seed: int, index: int, position: int) -> float:
        self._generator.manual_seed(draw_key(seed, index, position))
        return 1.0 - torch.rand(1, dtype=torch.float64, generator=self._generator).item()
