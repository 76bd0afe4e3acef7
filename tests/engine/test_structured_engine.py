"""Structured output in the batching engine: grammars compile off the loop, every constrained
sequence ends in JSON its schema accepts, even on an untrained model, and preemption keeps it."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import jsonschema
import pytest

from engine import protocol
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.test_llm_engine import drain, request, text

CLOSED = {  # every value bounded: an untrained model must still close it in max_tokens
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["sea", "lake", "river"]},
        "depth": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "ok", "kind", "depth", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=256, block_size=16,
                                  max_num_batched_tokens=256))


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1400) for _ in range(rng.randrange(3, 40))]


def test_every_sampled_answer_is_valid_json_for_its_schema(engine):
    grammar = {"type": "json_schema", "schema": CLOSED}
    for seed in range(24):
        engine.add_request(request(f"s{seed}", prompt(seed), max_tokens=120, temperature=1.0,
                                   seed=seed, grammar=grammar))
    outputs = drain(engine)
    for seed in range(24):
        outs = outputs[f"s{seed}"]
        assert outs[-1].finish_reason == "stop", text(outs)
        jsonschema.validate(json.loads(text(outs)), CLOSED)


def test_json_object_gives_an_object_and_greedy_plain_rows_are_unchanged(engine):
    engine.add_request(request("plain", prompt(1), max_tokens=12))
    alone = text(drain(engine)["plain"])
    engine.add_request(request("plain", prompt(1), max_tokens=12))
    engine.add_request(request("obj", prompt(2), max_tokens=60, grammar={
        "type": "json_schema", "schema": {"type": "object", "properties": {
            "a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}}))
    outputs = drain(engine)
    assert text(outputs["plain"]) == alone  # a constrained neighbour changes nothing
    assert json.loads(text(outputs["obj"])) in ({"a": True}, {"a": False})


def test_a_schema_the_engine_cannot_enforce_fails_only_its_request(engine):
    engine.add_request(request("bad", prompt(3), grammar={
        "type": "json_schema", "schema": {"type": "object", "not": {}}}))
    engine.add_request(request("good", prompt(4), max_tokens=4))
    outputs = drain(engine)
    (bad,) = outputs["bad"]
    assert bad.error_code == protocol.ERROR_INVALID_REQUEST and "'not'" in bad.error
    assert bad.usage.prompt_tokens == 0
    assert outputs["good"][-1].finish_reason == "length"


def test_a_slow_compile_never_stalls_the_batch(engine):
    # The slowest schema the bounds admit: 128 optional properties (about 0.2 s to compile).
    slow = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(128)}}
    engine.add_request(request("slow", prompt(5), max_tokens=4,
                               grammar={"type": "json_schema", "schema": slow}))
    engine.add_request(request("fast", prompt(6), max_tokens=2))
    finished_while_compiling = False
    outputs: dict[str, list] = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
            if out.request_id == "fast" and out.finished:
                finished_while_compiling = "slow" in engine._compiling
    assert finished_while_compiling
    assert outputs["slow"][-1].finished and not outputs["slow"][-1].error


def test_a_cancelled_request_still_compiling_ends_at_once(engine):
    slow = {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(128)}}
    engine.add_request(request("gone", prompt(7), grammar={"type": "json_schema",
                                                           "schema": slow}))
    out = engine.abort_request("gone", protocol.FINISH_CANCELLED)
    assert out.finished and out.finish_reason == protocol.FINISH_CANCELLED
    assert not engine.has_unfinished()


def test_preempted_constrained_sequences_resume_their_grammar(tiny_model_dir):
    small = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=24, block_size=4,
                                   max_num_batched_tokens=64))
    grammar = {"type": "json_schema", "schema": CLOSED}
    for seed in range(6):
        small.add_request(request(f"p{seed}", prompt(seed), max_tokens=60, temperature=1.0,
                                  seed=seed, grammar=grammar))
    outputs = drain(small)
    assert small.scheduler.num_preemptions > 0
    for seed in range(6):
        outs = outputs[f"p{seed}"]
        if outs[-1].finish_reason == "stop":
            jsonschema.validate(json.loads(text(outs)), CLOSED)
        else:  # cut at max_tokens: still a prefix the grammar allowed
            assert outs[-1].finish_reason == "length"


def test_a_constrained_adapter_request_shares_the_batch_with_plain_and_base_rows(
        tiny_model_dir, tmp_path):
    from lora_testing import peft_greedy, train_adapter

    from engine.lora.store import AdapterStore

    folder = train_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    adapter_hash = AdapterStore(tmp_path / "store").put(folder)
    eng = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=256, block_size=16,
                                 max_num_batched_tokens=256, adapter_store=tmp_path / "store"))
    grammar = {"type": "json_schema", "schema": CLOSED}
    eng.add_request(request("json", prompt(11), max_tokens=120, temperature=1.0, seed=1,
                            grammar=grammar, adapter="a1", adapter_hash=adapter_hash))
    eng.add_request(request("plain", prompt(12), max_tokens=10, adapter="a1",
                            adapter_hash=adapter_hash))
    eng.add_request(request("base", prompt(13), max_tokens=120, grammar=grammar))
    outputs = drain(eng)
    jsonschema.validate(json.loads(text(outputs["json"])), CLOSED)
    jsonschema.validate(json.loads(text(outputs["base"])), CLOSED)
    expected = peft_greedy(tiny_model_dir, folder, [prompt(12)], 10)[0]
    assert [t for o in outputs["plain"] for t in o.token_ids] == expected


def test_without_a_grammar_compiler_a_constrained_request_is_refused_and_others_run(
        tiny_model_dir):
    eng = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=64, block_size=16))
    eng._grammars_setup.join()
    eng._grammars = None  # as when the set-up failed (logged at start)
    with pytest.raises(ValueError, match="structured outputs are unavailable"):
        eng.add_request(request("json", prompt(1), grammar={"type": "json_object"}))
    eng.add_request(request("plain", prompt(1), max_tokens=3))
    assert drain(eng)["plain"][-1].finish_reason == "length"
