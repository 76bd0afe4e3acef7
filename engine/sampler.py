"""Turning logits into tokens: logit bias, penalties, grammar masks, then greedy or
temperature/top-k/top-p, with per-request seeds; logprobs of what was sampled.

The n-th token of a request is drawn from a random stream keyed by (seed, n) alone,
so a seeded request samples the same tokens whatever else shares its batch, and a
request that is preempted and recomputed continues exactly where it was. Rows are
sampled independently: a row whose logits are not finite fails alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from engine.batch import SampleFailure, ScheduledRequest, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.seeds import stream_seed

log = logging.getLogger(__name__)

NOT_FINITE = "the model produced logits that are not finite (NaN or infinite)"
_NOTHING_LEFT = "no token is allowed here (the grammar and min_tokens masked them all)"


def shape_logits(logits: torch.Tensor, params: SamplingParams, history: Sequence[int],
                 num_prompt_tokens: int) -> torch.Tensor:
    """``logits`` [vocab] (float32, modified in place) after logit_bias, min_tokens and the
    penalties; ``history`` is the prompt followed by the output so far."""
    vocab = logits.numel()
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < vocab]
        logits[ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=logits.dtype)
    if len(history) - num_prompt_tokens < params.min_tokens:
        masked = [t for t in params.min_tokens_masked if t < vocab]
        logits[masked] = float("-inf")
    if params.presence_penalty or params.frequency_penalty:
        output = torch.tensor(history[num_prompt_tokens:], dtype=torch.long)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)  # [vocab]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.repetition_penalty != 1.0 and history:
        seen = torch.unique(torch.tensor(history, dtype=torch.long))
        seen = seen[seen < vocab]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    return logits


def token_logprobs(raw: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The sampled token's log-probability and the ``k`` most likely under the model's own
    distribution: the log-softmax of ``raw`` [vocab], before temperature, penalties, bias,
    top-k/top-p or a grammar shaped it."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)  # [vocab]
    top = torch.topk(logprobs, k) if k else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
    return TokenLogprobs(logprob=float(logprobs[token]), top=pairs)


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """One token id from ``logits`` [vocab]: argmax when greedy, else temperature/top-k/top-p.

    Tokens at -inf (masked by a grammar or min_tokens) are never drawn. Raises ValueError
    when the logits hold a NaN or +inf, or no token is left.
    """
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise ValueError(NOT_FINITE)
    if bool(torch.isneginf(logits).all()):
        raise ValueError(_NOTHING_LEFT)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = probabilities(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator_for(seed, step, probs.device)))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy row samples from: ``logits`` [vocab] after temperature,
    top-k and top-p, as probabilities [vocab] (float32)."""
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
    return torch.softmax(logits, dim=-1)  # [vocab]


def generator_for(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The random stream of draw ``step`` of a request seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(stream_seed(seed, step))


def sample_batch(logits: torch.Tensor, rows: Sequence[ScheduledRequest], *,
                 masks: Any = None) -> tuple[list[int | SampleFailure], list[TokenLogprobs | None]]:
    """One token per row of ``logits`` [rows, vocab], and its logprobs where asked for.

    ``masks``: the rows' grammar masks, already filled (``engine.grammar.fill_bitmasks``);
    without them a constrained row's mask is filled here.

    Rows that only need argmax take it in one call. A row that cannot be sampled gives a
    ``SampleFailure`` and the other rows their tokens: rows of one batch belong to
    different tenants.
    """
    finite = torch.isfinite(logits).all(dim=-1).tolist()  # [rows]
    raw = logits
    shaped = {i for i, r in enumerate(rows) if r.sampling.shapes_logits or r.grammar is not None}
    if shaped:
        logits = logits.float().clone()
        for i in shaped:
            r = rows[i]
            if r.sampling.shapes_logits:
                shape_logits(logits[i], r.sampling, r.history, r.num_prompt_tokens)
        if any(r.grammar is not None for r in rows):
            # NOTE: imported here: an engine that is never asked for a grammar never loads
            # xgrammar.
            from engine.grammar import apply_bitmasks, apply_grammars

            if masks is not None:
                apply_bitmasks(logits, masks)
            else:
                apply_grammars(logits, [r.grammar for r in rows])
    greedy = torch.argmax(logits, dim=-1).tolist()  # [rows]
    out: list[int | SampleFailure] = []
    for i, r in enumerate(rows):
        if not finite[i]:
            out.append(SampleFailure(NOT_FINITE))
        elif r.sampling.greedy and i not in shaped:
            out.append(greedy[i])
        else:
            try:
                out.append(sample(logits[i], r.sampling, r.seed, r.num_output_tokens))
            except Exception as exc:  # noqa: BLE001 - fails this row's request, not the batch
                log.exception("sampling a row failed")
                out.append(SampleFailure(f"sampling failed: {type(exc).__name__}: {exc}"[:500]))
    logprobs: list[TokenLogprobs | None] = [
        token_logprobs(raw[i], token, r.sampling.logprobs)
        if r.sampling.logprobs is not None and isinstance(token, int) else None
        for i, (r, token) in enumerate(zip(rows, out, strict=True))]
    return out, logprobs
