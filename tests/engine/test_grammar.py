from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, Optional

import jsonschema
import pytest
import torch
import xgrammar as xgr
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from engine.config import eos_token_ids
from engine.grammar import GrammarError, Grammars, GrammarState, apply_grammars

OBJECT = {"type": "object", "properties": {
    "color": {"type": "string", "enum": ["red", "green", "blue"]},
    "ok": {"type": "boolean"},
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "name": {"type": "string", "maxLength": 8},
}, "required": ["color", "ok", "count", "name"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "rows": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}},
    "tag": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/Tag"}]},
}, "required": ["rows", "tag"], "$defs": {"Tag": {"type": "string", "enum": ["a", "b"]}}}


def schema_spec(schema: dict) -> dict:
    return {"type": "json_schema", "schema": schema}


@pytest.fixture(scope="module")
def vocab_size(tiny_model_dir: Path) -> int:
    return json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def stops(tiny_model_dir: Path) -> frozenset[int]:
    return eos_token_ids(tiny_model_dir)


@pytest.fixture
def grammars(tiny_model_dir: Path, vocab_size: int, stops: frozenset[int]) -> Iterator[Grammars]:
    grammars = Grammars(tiny_model_dir, vocab_size, stops, cache_size=4)
    yield grammars
    grammars.close()


@pytest.fixture(scope="module")
def raw_compiler(tiny_model_dir: Path, vocab_size: int,
                 stops: frozenset[int]) -> xgr.GrammarCompiler:
    """xgrammar with none of our checks, to show what it does with a keyword on its own."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=sorted(stops))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def accepts(compiled: xgr.CompiledGrammar, text: str, stop: int) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(stop)


def greedy_decode(state: GrammarState, vocab_size: int, stops: frozenset[int], *, seed: int,
                  max_steps: int = 200, bias: torch.Tensor | None = None) -> list[int]:
    """Argmax over random logits: an untrained model at its worst, held by the grammar alone."""
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, vocab_size, generator=generator)  # [1, vocab]
        if bias is not None:
            logits += bias
        apply_grammars(logits, [state])
        token = int(logits[0].argmax())
        assert state.accept(token)
        if token in stops:
            break
        tokens.append(token)
    return tokens


def test_the_second_submit_of_a_schema_is_a_cache_hit(grammars: Grammars):
    first = grammars.submit(schema_spec(OBJECT))
    assert isinstance(first.result(timeout=30), xgr.CompiledGrammar)
    again = grammars.submit(json.loads(json.dumps(schema_spec(OBJECT), sort_keys=True)))
    assert again is first
    assert (grammars.hits, grammars.misses, grammars.compiles) == (1, 1, 1)
    assert grammars.last_compile_seconds > 0


def test_a_compile_no_request_waits_for_is_dropped_while_it_queues(grammars: Grammars):
    release = threading.Event()
    grammars._pool.submit("t", lambda _: release.wait(), None)  # the tenant's one share
    shared = grammars.submit(schema_spec(NESTED), tenant="t")
    assert grammars.submit(schema_spec(NESTED), tenant="t") is shared  # two requests wait
    alone = grammars.submit(schema_spec(OBJECT), tenant="t")
    grammars.abandon(alone)
    grammars.abandon(shared)  # one of its two requests went away: it still compiles
    assert alone.cancelled() and not shared.cancelled()
    release.set()
    assert shared.result(timeout=30) is not None
    again = grammars.submit(schema_spec(OBJECT), tenant="t")  # asked anew: compiled anew
    assert again is not alone and again.result(timeout=30) is not None
    assert grammars.compiles == 2


def test_another_tenants_queued_compile_of_the_same_spec_is_not_waited_for(
        grammars: Grammars):
    release = threading.Event()
    grammars._pool.submit("hostile", lambda _: release.wait(), None)  # hostile's one share
    theirs = grammars.submit(schema_spec(NESTED), tenant="hostile")  # queued behind it
    ours = grammars.submit(schema_spec(NESTED), tenant="quiet")
    try:
        assert ours is not theirs and ours.result(timeout=30) is not None
        assert not theirs.done()
    finally:
        release.set()
    assert theirs.result(timeout=30) is not None


def test_identical_specs_in_flight_share_one_compile(grammars: Grammars):
    release = threading.Event()
    grammars._pool.submit("", lambda _: release.wait(), None)  # the tenant's one share
    first, second = grammars.submit(schema_spec(NESTED)), grammars.submit(schema_spec(NESTED))
    assert not first.done()
    release.set()
    assert second is first and first.result(timeout=30) is not None
    assert (grammars.hits, grammars.misses, grammars.compiles) == (1, 1, 1)


def test_the_least_recently_used_grammar_is_dropped(grammars: Grammars):
    specs = [schema_spec({"type": "string", "maxLength": n}) for n in range(1, 6)]
    futures = [grammars.submit(spec) for spec in specs]
    assert grammars.submit(specs[-1]) is futures[-1]
    assert grammars.submit(specs[0]) is not futures[0]


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, "patternProperties"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({"type": "string", "format": "iri"}, "format"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
])
def test_a_refused_keyword_is_a_grammar_error_naming_it(grammars: Grammars, schema, keyword):
    with pytest.raises(GrammarError, match=f"'{keyword}'"):
        grammars.submit(schema_spec(schema)).result(timeout=30)


@pytest.mark.parametrize(("spec", "message"), [
    (schema_spec({"type": "string", "pattern": "(("}), "parenthesis is not closed"),
    (schema_spec({"type": "integer", "minimum": "x"}), "'minimum' must be a number"),
    (schema_spec({"$ref": "#/$defs/Missing"}), "names no schema"),
    (schema_spec([]), "must be a JSON object"),
    ({"type": "json_schema"}, "'schema' is required"),
    ({"type": "regex"}, "must be 'json_object' or 'json_schema'"),
])
def test_an_invalid_spec_is_a_grammar_error(grammars: Grammars, spec, message):
    with pytest.raises(GrammarError, match=message):
        grammars.submit(spec).result(timeout=30)


def test_a_refused_spec_is_not_cached(grammars: Grammars):
    spec = schema_spec({"type": "string", "pattern": "(("})
    first = grammars.submit(spec)
    with pytest.raises(GrammarError):
        first.result(timeout=30)
    assert grammars.submit(spec) is not first


@pytest.mark.parametrize(("schema", "breaking"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"type": "number", "multipleOf": 0.5}, "1.3"),
    ({"type": "integer", "not": {"const": 3}}, "3"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1]"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ({"allOf": [{"type": "integer", "minimum": 1}, {"type": "integer", "maximum": 3}]}, "5"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ({"type": "string", "format": "iri"}, '"x y"'),
    ({"minLength": 3}, '"ab"'),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "maximum": 3}, "5"),
    ({"type": "string", "enum": ["a", 1]}, "1"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "required": ["a"]}, "{}"),
])
def test_xgrammar_still_ignores_what_we_refuse(raw_compiler, stops, schema, breaking):
    """If this fails after an upgrade, xgrammar enforces the keyword: lift its refusal."""
    compiled = raw_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    assert accepts(compiled, breaking, min(stops))


@pytest.mark.parametrize(("schema", "breaking"), [
    ({"type": "string", "pattern": "^a+$"}, '"b"'),
    ({"type": "string", "format": "date"}, '"2020-13"'),
    ({"type": "string", "minLength": 3, "maxLength": 4}, '"ab"'),
    ({"type": "integer", "exclusiveMinimum": 5, "maximum": 9}, "5"),
    ({"type": "integer", "multipleOf": 3}, "7"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1, 2]"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
     '{"a": 1, "b": 2}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1, "z": 2}'),
    (NESTED, '{"rows": [], "tag": "c"}'),
])
def test_what_we_accept_is_enforced(grammars: Grammars, stops, schema, breaking):
    compiled = grammars.submit(schema_spec(schema)).result(timeout=30)
    assert not accepts(compiled, breaking, min(stops))


def test_an_openai_strict_schema_accepts_its_instances(grammars: Grammars, stops):
    class Item(BaseModel):
        name: str = Field(max_length=20)
        qty: int = Field(ge=0, le=100)

    class Order(BaseModel):
        kind: Literal["a", "b"]
        items: list[Item]
        note: Optional[str]  # noqa: UP045 - the spelling the SDK's users write
        parent: Optional[Order]  # noqa: UP045

    compiled = grammars.submit(schema_spec(to_strict_json_schema(Order))).result(timeout=30)
    child = Order(kind="a", items=[Item(name='say "hi"', qty=1)], note=None, parent=None)
    good = Order(kind="b", items=[Item(name="x", qty=100)], note="é\n", parent=child)
    assert accepts(compiled, json.dumps(good.model_dump(), ensure_ascii=False), min(stops))
    bad = good.model_dump() | {"kind": "c"}
    assert not accepts(compiled, json.dumps(bad, ensure_ascii=False), min(stops))


@pytest.mark.parametrize("schema", [OBJECT, NESTED], ids=["object", "nested"])
@pytest.mark.parametrize("seed", range(5))
def test_random_logits_decode_to_json_the_schema_accepts(grammars: Grammars, tokenizer: Tokenizer,
                                                        vocab_size, stops, schema, seed):
    state = grammars.state(grammars.submit(schema_spec(schema)).result(timeout=30))
    tokens = greedy_decode(state, vocab_size, stops, seed=seed)
    assert state.is_terminated
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)


@pytest.mark.parametrize("seed", range(5))
def test_json_object_decodes_to_an_object(grammars: Grammars, tokenizer: Tokenizer,
                                          vocab_size, stops, seed):
    """Free-form strings are unbounded, so this model leans towards quotes, brackets and EOS."""
    closing = [i for i in range(vocab_size)
               if i in stops or any(c in tokenizer.id_to_token(i) for c in '"}]')]
    bias = torch.zeros(1, vocab_size)
    bias[0, closing] = 3.0
    state = grammars.state(grammars.submit({"type": "json_object"}).result(timeout=30))
    tokens = greedy_decode(state, vocab_size, stops, seed=seed, bias=bias)
    assert state.is_terminated
    assert isinstance(json.loads(tokenizer.decode(tokens)), dict)


def test_json_object_starts_with_a_brace(grammars: Grammars, tokenizer: Tokenizer,
                                         vocab_size: int):
    state = grammars.state(grammars.submit({"type": "json_object"}).result(timeout=30))
    logits = torch.zeros(1, vocab_size)
    apply_grammars(logits, [state])
    allowed = (logits[0] == 0).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([i]).startswith("{") for i in allowed)


def test_a_bounded_string_is_a_json_string(grammars: Grammars, stops):
    """xgrammar 0.2.8 admits raw control characters there, and no escape; Grammars fixes both."""
    compiled = grammars.submit(schema_spec({"type": "string", "maxLength": 4})).result(timeout=30)
    for text in ('"a b"', '"\\"\\n"', '"\\u00e9\\\\é"'):
        assert accepts(compiled, text, min(stops)), text
    for text in ('"a\x1db"', '"abcde"', '"\\x"'):
        assert not accepts(compiled, text, min(stops)), text


def test_special_tokens_are_never_part_of_a_string(grammars: Grammars, tokenizer: Tokenizer,
                                                   vocab_size: int):
    state = grammars.state(grammars.submit(schema_spec({"type": "string"})).result(timeout=30))
    assert state.accept(tokenizer.token_to_id('"'))
    logits = torch.zeros(1, vocab_size)
    apply_grammars(logits, [state])
    for special in ("<|begin_of_text|>", "<|user|>", "<|assistant|>", "<|end|>"):
        assert logits[0, tokenizer.token_to_id(special)] == float("-inf")


def test_apply_grammars_leaves_unconstrained_rows_bit_identical(grammars: Grammars,
                                                                vocab_size: int):
    state = grammars.state(grammars.submit(schema_spec(OBJECT)).result(timeout=30))
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    apply_grammars(logits, [None, state, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = logits[1] != float("-inf")
    assert 0 < int(allowed.sum()) < vocab_size
    assert torch.equal(logits[1][allowed], before[1][allowed])


def test_apply_grammars_without_a_grammar_touches_nothing():
    logits = torch.randn(2, 7)
    before = logits.clone()
    apply_grammars(logits, [None, None])
    assert torch.equal(logits, before)


def test_padded_logits_never_allow_a_padding_id(tiny_model_dir: Path, vocab_size: int, stops):
    padded = Grammars(tiny_model_dir, vocab_size + 37, stops)
    try:
        state = padded.state(padded.submit({"type": "json_object"}).result(timeout=30))
        logits = torch.zeros(1, vocab_size + 37)
        apply_grammars(logits, [state])
        assert bool((logits[0, vocab_size:] == float("-inf")).all())
        assert bool((logits[0, :vocab_size] == 0).any())
    finally:
        padded.close()


def test_rollback_restores_the_mask(grammars: Grammars, vocab_size: int, stops):
    state = grammars.state(grammars.submit(schema_spec(OBJECT)).result(timeout=30))
    initial = xgr.allocate_token_bitmask(1, vocab_size)
    state.fill(initial, 0)
    tokens = greedy_decode(state, vocab_size, stops, seed=3, max_steps=6)
    state.rollback(len(tokens))
    after = xgr.allocate_token_bitmask(1, vocab_size)
    state.fill(after, 0)
    assert len(tokens) == 6 and torch.equal(after, initial)


def test_a_forked_state_starts_where_its_parent_is_and_moves_alone(grammars: Grammars,
                                                                    vocab_size: int, stops):
    state = grammars.state(grammars.submit(schema_spec(OBJECT)).result(timeout=30))
    fork = state.fork()
    initial = xgr.allocate_token_bitmask(1, vocab_size)
    state.fill(initial, 0)
    forked = xgr.allocate_token_bitmask(1, vocab_size)
    fork.fill(forked, 0)
    assert torch.equal(forked, initial)
    greedy_decode(state, vocab_size, stops, seed=3, max_steps=6)
    fork.fill(forked, 0)
    assert torch.equal(forked, initial)  # the parent's tokens did not move the fork


@pytest.fixture(scope="module")
def token_bytes(tiny_model_dir: Path, vocab_size: int, stops) -> list[bytes]:
    """Each token's bytes as xgrammar matches them (the ByteLevel alphabet decoded)."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"))
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stops)).decoded_vocab


def byte_token(token_bytes: list[bytes], byte: int) -> int:
    return token_bytes.index(bytes([byte]))


@pytest.mark.parametrize("spec", [
    schema_spec({"type": "string"}),
    schema_spec({"type": "string", "maxLength": 4}),
    schema_spec({"type": "string", "pattern": "^.+$"}),
], ids=["string", "bounded", "pattern"])
def test_a_string_never_takes_the_bytes_of_a_utf16_surrogate(grammars: Grammars, token_bytes,
                                                             vocab_size: int, spec):
    """xgrammar's "any character" admits ED A0..BF xx (U+D800..U+DFFF), which no UTF-8
    decoder reads; after the lead byte ED only 80..9F may follow."""
    state = grammars.state(grammars.submit(spec).result(timeout=30))
    assert state.accept(token_bytes.index(b'"')) and state.accept(byte_token(token_bytes, 0xED))
    logits = torch.zeros(1, vocab_size)
    apply_grammars(logits, [state])
    allowed = {b for b in range(0x80, 0xC0) if logits[0, byte_token(token_bytes, b)] == 0}
    assert allowed == set(range(0x80, 0xA0))
    assert not state.accept(byte_token(token_bytes, 0xB0))
    assert state.accept(byte_token(token_bytes, 0x9F))  # U+D7C0.. is a character


@pytest.mark.parametrize("seed", range(4))
def test_surrogate_bytes_never_come_out_of_a_schema(grammars: Grammars, token_bytes,
                                                   vocab_size, stops, seed):
    """An untrained model that favours the bytes of surrogates (ED, then A0..BF) and high
    bytes: its output decodes strictly, and a maxLength counts what a client counts."""
    bias = torch.zeros(1, vocab_size)
    bias[0, [byte_token(token_bytes, b) for b in range(0x80, 0x100)]] = 4.0
    bias[0, [byte_token(token_bytes, b) for b in [0xED, *range(0xA0, 0xC0)]]] = 8.0
    state = grammars.state(grammars.submit(schema_spec(OBJECT)).result(timeout=30))
    tokens = greedy_decode(state, vocab_size, stops, seed=seed, bias=bias)
    text = b"".join(token_bytes[t] for t in tokens).decode("utf-8")  # strict
    jsonschema.validate(json.loads(text), OBJECT)
    assert any(ord(c) > 0x7F for c in json.loads(text)["name"])  # the bias took effect


def test_a_draft_is_verified_up_to_its_stop_token(grammars: Grammars, token_bytes, stops):
    """A draft (a draft model's) that ends the grammar is cut before the stop token: no
    mask follows one, and the model's own sample may still end the text there."""
    state = grammars.state(grammars.submit(
        schema_spec({"type": "string", "maxLength": 4})).result(timeout=30))
    quote, a = token_bytes.index(b'"'), token_bytes.index(b"a")
    draft = [quote, a, a, quote, min(stops), a]
    assert state.accepts_prefix(draft) == 4
    masks = state.fill_along(draft[:4])
    assert masks.rows == [0, 1, 2, 3, 4]
    assert masks.bitmask[4].any()  # the stop token is allowed after the closing quote
    assert state.accept(quote)  # the state was left at the start


def test_a_finished_grammar_verifies_no_draft_and_stays_finished(grammars: Grammars,
                                                                  token_bytes, vocab_size,
                                                                  stops):
    state = grammars.state(grammars.submit(
        schema_spec({"type": "string", "maxLength": 4})).result(timeout=30))
    quote, a = token_bytes.index(b'"'), token_bytes.index(b"a")
    for token in (quote, a, quote, min(stops)):
        assert state.accept(token)
    assert state.is_terminated
    assert state.accepts_prefix([a, quote]) == 0
    assert state.is_terminated
    state.rollback(2)  # the stop token and the closing quote: the string is open again
    assert state.accept(a) and not state.is_terminated
