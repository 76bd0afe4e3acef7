"""Random streams keyed by a request's seed alone, pure Python (splitmix64).

Token k of a sequence is drawn from the stream ``stream_seed(seed, k)``, so a seeded request
samples the same whatever shares its batch, and after a recompute. Choice k of a request
with several (engine/parallel.py: prompt p's sample i is k = p * n + i) has the seed
``choice_seed(seed, k)``.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def stream_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for draw ``step`` of a request seeded with ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``; choice 0 keeps it.

    NOTE: draws take the steps >= 0 of ``stream_seed``, choices the steps below -1, so no
    choice's seed is one of the request's own draws.
    """
    return seed if index == 0 else stream_seed(seed, -1 - index)
