"""Tool calls in a model's free output: parsed whole and streamed, alike however chunked."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.served_models import load_served_model
from inference.tools import (
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCallParser,
    parser_for,
)
from tests.inference.tool_testing import assemble


def block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# (text, content, [(name, arguments)]) as parse() must read them
HERMES = [
    ("Plain words, no calls.", "Plain words, no calls.", []),
    ("", "", []),
    (block("get_weather", '{"city": "Paris"}'), None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me look.\n\n" + block("get_weather", '{"city": "Paris"}') + "\n"
     + block("now", "{}"),
     "Let me look.", [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    ('<tool_call>{"arguments": {"q": "a } ] \\" {"}, "name": "search"}</tool_call>', None,
     [("search", '{"q": "a } ] \\" {"}')]),
    ('<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", "{}")]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": null}], "c": "ü🚀\\n"}}',
     None, [("f", '{"a": [1, {"b": null}], "c": "ü🚀\\n"}')]),  # no closing tag: stopped there
    ('x<tool_call> {"name":"f","arguments":{}} </tool_call> dropped words', "x", [("f", "{}")]),
    ('<tool_call>\n{"name": "f", "type": "function", "arguments": {"x": 1.5e3}, "n": -2}\n'
     '</tool_call>', None, [("f", '{"x": 1.5e3}')]),
]

LLAMA3 = [
    ("Just words.", "Just words.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "now", "parameters": {}}',
     None, [("f", '{"a": 1}'), ("now", "{}")]),
    ('  {"parameters": {"a": "}"}, "name": "f"}', None, [("f", '{"a": "}"}')]),
]

MALFORMED = [  # each is content, whole
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    'Sure <tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call>',
    '<tool_call>\n{"name": "f", "name": "g", "arguments": {}}\n</tool_call>',
    "<tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1',  # cut short by max_tokens
]


def calls_of(parsed) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in parsed.tool_calls]


@pytest.mark.parametrize("text, content, calls", HERMES)
def test_hermes_parse(text, content, calls):
    parsed = HermesToolParser.parse(text)
    assert (parsed.content, calls_of(parsed)) == (content, calls)
    for (_, arguments), call in zip(calls, parsed.tool_calls, strict=True):
        assert isinstance(json.loads(call.arguments), dict) and call.arguments == arguments
        assert re.fullmatch(r"call_[A-Za-z0-9_-]{24}", call.id)


@pytest.mark.parametrize("text, content, calls", LLAMA3)
def test_llama3_json_parse(text, content, calls):
    parsed = Llama3JsonToolParser.parse(text)
    assert (parsed.content, calls_of(parsed)) == (content, calls)


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_are_plain_content(text):
    parsed = HermesToolParser.parse(text)
    assert parsed.content == text and parsed.tool_calls == []


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": {}} and more', '{"name": "f"',
                                  "<|python_tag|>", '{"name": "f", "parameters": [1]}'])
def test_malformed_llama3_calls_are_plain_content(text):
    assert Llama3JsonToolParser.parse(text).content == text


def stream(parser: ToolCallParser, text: str, rng: random.Random) -> list:
    deltas, i = [], 0
    while i < len(text):
        size = rng.choice([1, 1, 2, 3, 5, 8, 13, 40])
        deltas += parser.feed(text[i:i + size])
        i += size
    return deltas + parser.finish()


WHOLE_AS_STREAMED = ([(HermesToolParser, t) for t, _, _ in HERMES]
                     + [(Llama3JsonToolParser, t) for t, _, _ in LLAMA3]
                     # malformed before any call went out: content, however it is chunked
                     + [(HermesToolParser, t) for t in MALFORMED[:4] + MALFORMED[7:8]])


@pytest.mark.parametrize("fmt, text", WHOLE_AS_STREAMED)
def test_streamed_deltas_equal_parse_over_random_chunkings(fmt, text):
    parsed = fmt.parse(text)
    rng = random.Random(text)
    for _ in range(200):
        parser = fmt()
        content, calls, ids = assemble(stream(parser, text, rng))
        assert (content or None, calls) == (
            parsed.content or None, calls_of(parsed))
        assert ids == [call.id for call in parser.tool_calls] and len(set(ids)) == len(ids)
        assert not parser.malformed or parsed.tool_calls == []


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=8)
tool_names = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)


@settings(max_examples=150, deadline=None)
@given(prefix=st.text(max_size=30).filter(lambda t: "<tool_call>" not in t),
       calls=st.lists(st.tuples(tool_names, arguments), max_size=3),
       indent=st.sampled_from([None, 1]), seed=st.integers())
def test_any_well_formed_hermes_output_parses_and_streams_alike(prefix, calls, indent, seed):
    text = prefix + "".join(
        "\n<tool_call>\n" + json.dumps({"name": name, "arguments": args}, indent=indent,
                                       ensure_ascii=False) + "\n</tool_call>"
        for name, args in calls)
    parsed = HermesToolParser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert parsed.content == ((prefix.rstrip() or None) if calls else text)
    content, streamed, _ = assemble(stream(HermesToolParser(), text, random.Random(seed)))
    assert (content or None, streamed) == (parsed.content or None, calls_of(parsed))


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(tool_names, arguments), min_size=1, max_size=3),
       tag=st.booleans(), seed=st.integers())
def test_any_well_formed_llama3_output_parses_and_streams_alike(calls, tag, seed):
    text = ("<|python_tag|>" if tag else "") + "; ".join(
        json.dumps({"name": name, "parameters": args}, ensure_ascii=False) for name, args in calls)
    parsed = Llama3JsonToolParser.parse(text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    content, streamed, _ = assemble(stream(Llama3JsonToolParser(), text, random.Random(seed)))
    assert (content, streamed) == ("", calls_of(parsed))


def test_arguments_stream_in_pieces_as_they_arrive():
    parser = HermesToolParser()
    deltas = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [d.tool_call["function"] for d in deltas] == [
        {"name": "get_weather", "arguments": ""}, {"arguments": '{"ci'}]
    assert parser.feed('ty": "Paris"}}')[0].tool_call == {
        "index": 0, "function": {"arguments": 'ty": "Paris"}'}}
    assert parser.feed("\n</tool_call>") == [] and parser.finish() == []


def test_a_partial_tag_is_held_back_until_it_proves_not_to_be_one():
    parser = HermesToolParser()
    assert [d.content for d in parser.feed("Hello <tool_")] == ["Hello"]
    assert [d.content for d in parser.feed("box> and")] == [" <tool_box> and"]
    assert [d.content for d in parser.feed(" <")] == []
    assert [d.content for d in parser.finish()] == [" <"]


def test_no_piece_of_a_tag_leaks_into_content():
    text = "Checking now.  \n" + block("now", "{}")
    for size in range(1, len(text)):
        parser = HermesToolParser()
        content = "".join(d.content for i in range(0, len(text), size)
                          for d in parser.feed(text[i:i + size]) if d.content)
        assert content == "Checking now."


def test_a_call_cut_short_after_it_went_out_stays_and_the_stream_says_so():
    parser = HermesToolParser()
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1'
    content, calls, _ = assemble(parser.feed(text) + parser.finish())
    assert (content, calls, parser.malformed) == ("", [("f", '{"a": 1')], True)
    assert parser.tool_calls == []
    assert HermesToolParser.parse(text).content == text  # whole, it is content


def test_a_call_of_many_kilobytes_streams_whole_a_few_characters_at_a_time():
    body = json.dumps({"name": "write", "arguments": {"text": "x = 1\n" * 40000}})
    text = f"<tool_call>{body}</tool_call>"
    parser = HermesToolParser()
    pieces = [d.tool_call["function"]["arguments"] for i in range(0, len(text), 4)
              for d in parser.feed(text[i:i + 4]) if d.tool_call]
    assert "".join(pieces) == json.dumps(json.loads(body)["arguments"])


def test_the_format_comes_from_the_model(tiny_model_path: Path):
    served = load_served_model(tiny_model_path, "tiny")
    assert parser_for(served) is HermesToolParser
    assert parser_for(dataclasses.replace(served, tool_format=None)) is None
    assert parser_for(dataclasses.replace(served, tool_format="unknown")) is None
