from __future__ import annotations

import pytest
import torch

from engine.batch import SampleFailure
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
    out = sample_batch(logits, [greedy, seeded, greedy, seeded], [1, 2, 3, 4], [0, 0, 0, 0])
    assert out[0] == 1
    assert isinstance(out[1], SampleFailure) and isinstance(out[2], SampleFailure)
    assert isinstance(out[3], int)
