"""Turning logits into tokens: greedy, temperature, top-k, top-p, with per-request seeds.

The n-th token of a request is drawn from a random stream keyed by (seed, n) alone,
so a seeded request samples the same tokens whatever else shares its batch, and a
request that is preempted and recomputed continues exactly where it was. Rows are
sampled independently: a row whose logits are not finite fails alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.batch import SampleFailure
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_NOT_FINITE = "the model produced logits that are not finite (NaN or infinite)"


def stream_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for draw ``step`` of a request seeded with ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """One token id from ``logits`` [vocab]: argmax when greedy, else temperature/top-k/top-p.

    Raises ValueError when the logits hold a NaN or an infinity.
    """
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(_NOT_FINITE)
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float()
    # NOTE: shifted so the largest logit is 0 before dividing: however small the
    # temperature, the others only fall towards -inf and the largest keeps probability > 0,
    # so softmax never sees inf - inf (NaN).
    logits = (logits - logits.max()) / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # [vocab]
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens before it already cover top_p; the first always stays.
        drop = torch.cumsum(probs, dim=-1) - probs > params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)  # [vocab]
    generator = torch.Generator(device=logits.device).manual_seed(stream_seed(seed, step))
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                 steps: Sequence[int]) -> list[int | SampleFailure]:
    """One token per row of ``logits`` [rows, vocab]; greedy rows in one argmax.

    A row that cannot be sampled gives a ``SampleFailure`` and the other rows their tokens:
    rows of one batch belong to different tenants.
    """
    finite = torch.isfinite(logits).all(dim=-1).tolist()  # [rows]
    greedy = torch.argmax(logits, dim=-1).tolist()  # [rows]
    out: list[int | SampleFailure] = []
    for i, p in enumerate(params):
        if not finite[i]:
            out.append(SampleFailure(_NOT_FINITE))
        elif p.greedy:
            out.append(greedy[i])
        else:
            try:
                out.append(sample(logits[i], p, seeds[i], steps[i]))
            except Exception as exc:  # noqa: BLE001 - fails this row's request, not the batch
                log.exception("sampling a row failed")
                out.append(SampleFailure(f"sampling failed: {type(exc).__name__}: {exc}"[:500]))
    return out
