from __future__ import annotations

import pytest

from engine import protocol
from engine.sampling_params import SamplingParams


def test_from_spec_copies_every_field():
    spec = protocol.SamplingSpec(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3,
                                 stop=["\n\n"], ignore_eos=True)
    params = SamplingParams.from_spec(spec)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed,
            params.stop, params.ignore_eos) == (7, 0.5, 0.9, 40, 3, ["\n\n"], True)


def test_zero_temperature_means_greedy():
    assert SamplingParams(max_tokens=1, temperature=0).greedy
    assert not SamplingParams(max_tokens=1, temperature=0.7).greedy


def test_a_temperature_too_small_to_divide_by_means_greedy():
    assert SamplingParams(max_tokens=1, temperature=1e-40).greedy
    assert not SamplingParams(max_tokens=1, temperature=1e-4).greedy


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(max_tokens=True), dict(max_tokens=1.5),
    dict(temperature=float("nan")), dict(temperature=-0.1), dict(top_p=1.5), dict(top_p=0),
    dict(top_k=-1), dict(seed="7"), dict(stop=[""]), dict(stop="stop"),
])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**({"max_tokens": 4} | bad))
