from __future__ import annotations

import dataclasses
import time

import pytest
from engine_testing import make_request, read_events, submit
from tokenizers import Tokenizer

from engine import protocol
from engine.outputs import RequestOutput
from engine.reference import ReferenceEngine, generate_reference

PROMPTS = [[0, 5, 100, 200], [0, *range(10, 60)], [0, 7], [0, 300, 301, 302, 303, 304, 305]]


@pytest.fixture
def engine(reference_engine_factory) -> ReferenceEngine:
    return reference_engine_factory()


def run(engine: ReferenceEngine, *requests: protocol.EngineRequest
        ) -> dict[str, list[RequestOutput]]:
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(out.text_delta for out in outputs)


def test_greedy_tokens_equal_transformers_generate(engine, tiny_model_dir):
    expected = generate_reference(tiny_model_dir, PROMPTS, max_new_tokens=24)
    outputs = run(engine, *(make_request(p, request_id=str(i), max_tokens=24)
                            for i, p in enumerate(PROMPTS)))
    assert [tokens(outputs[str(i)]) for i in range(len(PROMPTS))] == expected


def test_text_is_the_decode_of_the_tokens(engine, tokenizer: Tokenizer):
    outputs = run(engine, make_request(PROMPTS[1], request_id="r", max_tokens=30))["r"]
    assert text(outputs) == tokenizer.decode(tokens(outputs))


def test_same_seed_samples_the_same_tokens(engine):
    a = run(engine, make_request(PROMPTS[0], request_id="a", temperature=1.0, seed=7,
                                 max_tokens=20, top_p=0.9, top_k=50))
    b = run(engine, make_request(PROMPTS[0], request_id="b", temperature=1.0, seed=7,
                                 max_tokens=20, top_p=0.9, top_k=50))
    assert tokens(a["a"]) == tokens(b["b"])


def test_different_seeds_sample_different_tokens(engine):
    outs = run(engine, *(make_request(PROMPTS[0], request_id=str(s), temperature=1.0, seed=s,
                                      max_tokens=20) for s in (1, 2)))
    assert tokens(outs["1"]) != tokens(outs["2"])


def test_top_k_one_samples_the_greedy_token(engine):
    outs = run(engine, make_request(PROMPTS[2], request_id="g", max_tokens=12),
               make_request(PROMPTS[2], request_id="k", temperature=1.5, top_k=1, seed=3,
                            max_tokens=12))
    assert tokens(outs["k"]) == tokens(outs["g"])


def test_max_tokens_finishes_with_length(engine):
    final = run(engine, make_request(PROMPTS[0], request_id="r", max_tokens=5,
                                     ignore_eos=True))["r"][-1]
    assert final.finished and final.finish_reason == protocol.FINISH_LENGTH
    assert final.usage.completion_tokens == 5
    assert final.usage.prompt_tokens == len(PROMPTS[0]) and final.usage.cached_tokens == 0


def test_usage_carries_timings(engine):
    usage = run(engine, make_request(PROMPTS[0], request_id="r", max_tokens=3))["r"][-1].usage
    assert 0 <= usage.queue_s <= usage.ttft_s <= usage.total_s


def test_context_window_finishes_with_length_before_max_tokens(engine):
    prompt = [0] + [100] * (engine.max_model_len - 4)
    final = run(engine, make_request(prompt, request_id="r", max_tokens=50,
                                     ignore_eos=True))["r"][-1]
    assert final.finish_reason == protocol.FINISH_LENGTH
    assert final.usage.completion_tokens == 3


def test_eos_finishes_with_stop_unless_ignored(engine):
    first = tokens(run(engine, make_request(PROMPTS[0], request_id="g", max_tokens=1))["g"])[0]
    engine.eos_token_ids = frozenset({first})
    stopped = run(engine, make_request(PROMPTS[0], request_id="s", max_tokens=5))["s"]
    ignored = run(engine, make_request(PROMPTS[0], request_id="i", max_tokens=5,
                                       ignore_eos=True))["i"]
    assert stopped[-1].finish_reason == protocol.FINISH_STOP and tokens(stopped) == [first]
    assert ignored[-1].finish_reason == protocol.FINISH_LENGTH and len(tokens(ignored)) == 5


def test_stop_string_finishes_with_stop_and_is_not_emitted(engine, tokenizer: Tokenizer):
    full = run(engine, make_request(PROMPTS[1], request_id="full", max_tokens=30,
                                    ignore_eos=True))["full"]
    pieces = [tokenizer.decode([t]) for t in tokens(full)]
    # A stop string straddling the boundary between two printable tokens.
    i = next(i for i in range(3, len(pieces) - 1)
             if pieces[i].strip() and pieces[i + 1].strip()
             and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[i][-1] + pieces[i + 1][0]
    full_text = text(full)
    outs = run(engine, make_request(PROMPTS[1], request_id="s", max_tokens=30, ignore_eos=True,
                                    stop=[stop]))["s"]
    assert outs[-1].finish_reason == protocol.FINISH_STOP
    assert text(outs) == full_text[:full_text.index(stop)]
    assert stop not in text(outs)


def test_abort_mid_generation_returns_usage_so_far(engine):
    engine.add_request(make_request(PROMPTS[1], request_id="r", max_tokens=100,
                                    ignore_eos=True))
    for _ in range(5):
        engine.step()
    final = engine.abort_request("r", protocol.FINISH_CANCELLED)
    assert final.finished and final.finish_reason == protocol.FINISH_CANCELLED
    assert final.usage.completion_tokens == 5
    assert final.usage.prompt_tokens == len(PROMPTS[1])
    assert not engine.has_unfinished()


def test_abort_of_a_queued_request_reports_no_work(engine):
    engine.add_request(make_request(PROMPTS[0], request_id="running"))
    engine.add_request(make_request(PROMPTS[0], request_id="queued"))
    engine.step()
    assert engine.num_running() == 1 and engine.num_waiting() == 1
    final = engine.abort_request("queued", protocol.FINISH_CANCELLED)
    assert final.usage.prompt_tokens == 0 and final.usage.completion_tokens == 0
    assert engine.num_waiting() == 0
    assert engine.abort_request("unknown", protocol.FINISH_CANCELLED) is None


def test_requests_run_first_in_first_out(engine):
    engine.add_request(make_request(PROMPTS[0], request_id="first", max_tokens=2))
    engine.add_request(make_request(PROMPTS[0], request_id="second", max_tokens=2))
    order = [out.request_id for _ in range(4) for out in engine.step()]
    assert order == ["first", "first", "second", "second"]


def test_a_failing_request_does_not_stop_the_next(engine, monkeypatch):
    real = engine._advance

    def advance(active):
        if active.request.request_id == "bad":
            raise RuntimeError("simulated kernel failure")
        return real(active)

    monkeypatch.setattr(engine, "_advance", advance)
    outs = run(engine, make_request(PROMPTS[0], request_id="bad"),
               make_request(PROMPTS[0], request_id="good", max_tokens=4, ignore_eos=True))
    assert outs["bad"][-1].finished and "simulated kernel failure" in outs["bad"][-1].error
    assert outs["good"][-1].finish_reason == protocol.FINISH_LENGTH
    assert outs["good"][-1].error is None and len(tokens(outs["good"])) == 4


def test_passed_deadline_finishes_with_deadline(engine):
    outs = run(engine, make_request(PROMPTS[0], request_id="late", deadline=time.time() - 1,
                                    max_tokens=50))
    assert outs["late"][-1].finish_reason == protocol.FINISH_DEADLINE


def test_deadline_reached_mid_generation_stops_it(engine):
    engine.add_request(make_request(PROMPTS[0], request_id="r", max_tokens=500,
                                    ignore_eos=True, deadline=time.time() + 3600))
    engine.step()
    engine.running.request.deadline = time.time() - 0.001
    final = engine.step()[-1]
    assert final.finish_reason == protocol.FINISH_DEADLINE
    assert final.usage.completion_tokens == 1


@pytest.mark.parametrize("bad", [
    dict(prompt=[]),
    dict(prompt=[0, 10**9]),
    dict(prompt=[0] * 2048),
    dict(prompt=[0], max_tokens=0),
    dict(prompt=[0], temperature=-1.0),
    dict(prompt=[0], top_p=0.0),
    dict(prompt=[0], stop=[""]),
])
def test_invalid_requests_are_refused_at_add(engine, bad):
    prompt = bad.pop("prompt")
    with pytest.raises(ValueError):
        engine.add_request(make_request(prompt, **bad))
    assert not engine.has_unfinished()


def test_an_adapter_request_is_refused_not_answered_by_the_base_model(engine):
    request = make_request([1, 2, 3], request_id="lora")
    request = dataclasses.replace(request, adapter="acme/sea-poet", adapter_hash="ab" * 32)
    with pytest.raises(ValueError, match="reference engine runs the base model only"):
        engine.add_request(request)
    assert not engine.has_unfinished()


def test_an_adapter_request_gets_an_invalid_request_error_on_the_wire(
        start_worker, redis_client, reference_engine_factory):
    start_worker(engine_factory=lambda _model_dir: reference_engine_factory())
    lora = dataclasses.replace(make_request([1, 2, 3], max_tokens=2), adapter="acme/sea-poet",
                               adapter_hash="ab" * 32)
    base = make_request([1, 2, 3], max_tokens=2)
    submit(redis_client, lora)
    submit(redis_client, base)
    [event] = read_events(redis_client, lora.request_id)
    assert (event.type, event.data["code"]) == (protocol.EV_ERROR,
                                                protocol.ERROR_INVALID_REQUEST)
    assert "base model only" in event.data["message"]
    assert read_events(redis_client, base.request_id)[-1].type == protocol.EV_FINISH
