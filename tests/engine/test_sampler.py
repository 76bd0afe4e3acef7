from __future__ import annotations

import pytest
import torch

from engine.batch import SampleFailure, ScheduledRequest
from engine.sampler import sample, sample_batch
from engine.sampling_params import SamplingParams


def test_a_small_temperature_over_huge_logits_still_samples_the_top_token():
    logits = torch.tensor([0.0, 1e34, -1e34])  # / 2e-5 overflows fp32 unless shifted first
    params = SamplingParams(max_tokens=1, temperature=2e-5)
    assert sample(logits, params, seed=0, step=0) == 1


def test_non_finite_logits_are_refused():
    with pytest.raises(ValueError, match="not finite"):
        sample(torch.tensor([0.0, float("nan")]), SamplingParams(max_tokens=1), seed=0, step=0)


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.tensor([[0.0, 5.0, 1.0], [float("nan"), 0.0, 0.0], [3.0, 0.0, float("inf")],
                           [0.0, 0.0, 9.0]])
    greedy, seeded = SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=1)
    rows = [row(p, seed=s) for p, s in ((greedy, 1), (seeded, 2), (greedy, 3), (seeded, 4))]
    out, logprobs = sample_batch(logits, rows)
    assert logprobs == [None] * 4
    assert out[0] == 1
    assert isinstance(out[1], SampleFailure) and isinstance(out[2], SampleFailure)
    assert isinstance(out[3], int)


def row(params: SamplingParams, *, seed: int = 0, history: list[int] | None = None,
        num_prompt_tokens: int = 0) -> ScheduledRequest:
    return ScheduledRequest(request_id="r", token_ids=[0], start_pos=0, block_table=[0],
                            sample=True, sampling=params, seed=seed,
                            num_output_tokens=len(history or []) - num_prompt_tokens,
                            history=history or [], num_prompt_tokens=num_prompt_tokens)
