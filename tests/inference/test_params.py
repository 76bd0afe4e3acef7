"""Request validation: every bad field is a 400 naming the parameter."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.errors import InvalidRequest
from inference.params import CHAT_FIELDS, COMPLETION_FIELDS, parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("patch, param", [
    ({"model": 3}, "model"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": "high"}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_chat_field_is_rejected_with_its_name(patch, param):
    with pytest.raises(InvalidRequest) as err:
        parse_chat({**CHAT, **patch})
    assert err.value.param == param
    assert err.value.status == 400


def test_missing_model_is_reported_as_missing():
    with pytest.raises(InvalidRequest) as err:
        parse_chat({"messages": CHAT["messages"]})
    assert (err.value.param, err.value.code) == ("model", "missing_required_parameter")


def test_non_object_body_is_rejected():
    with pytest.raises(InvalidRequest):
        parse_completion(["model", "prompt"])


def test_chat_params_are_parsed():
    req = parse_chat({**CHAT, "max_completion_tokens": 5, "temperature": 0, "top_p": 0.5,
                      "stop": "x", "seed": 3, "stream": True,
                      "stream_options": {"include_usage": True}})
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed, p.stream, p.include_usage) == \
        (5, 0.0, 0.5, ["x"], 3, True, True)


def test_developer_role_reads_as_system_and_text_parts_are_joined():
    req = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]})
    assert req.messages == [{"role": "system", "content": "ab"}]


@pytest.mark.parametrize("prompt, expected", [
    ("hello", ["hello"]), (["hello"], ["hello"]), ([1, 2, 3], [[1, 2, 3]]),
    ([[4, 5]], [[4, 5]]), (["a", "b"], ["a", "b"]), (["a", [7]], ["a", [7]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion({"model": "m", "prompt": prompt}).prompts == expected


@pytest.mark.parametrize("prompt", [None, 5, [], ["a", 5], [1, -2], [1.5], ["x"] * 17,
                                    [[]]])
def test_bad_completion_prompts_are_rejected(prompt):
    with pytest.raises(InvalidRequest) as err:
        parse_completion({"model": "m", "prompt": prompt})
    assert err.value.param == "prompt"


def test_errors_name_the_max_tokens_field_the_client_used():
    from inference.params import parse_chat

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat({**base, "max_tokens": 5}).params.max_tokens_param == "max_tokens"
    assert parse_chat({**base, "max_completion_tokens": 5}).params.max_tokens_param == \
        "max_completion_tokens"


def test_negative_token_ids_are_an_invalid_value_not_a_second_prompt():
    import pytest

    from core.errors import InvalidRequest
    from inference.params import parse_completion

    with pytest.raises(InvalidRequest, match="non-negative") as err:
        parse_completion({"model": "m", "prompt": [-1, 2]})
    assert err.value.code == "invalid_value"


@pytest.mark.parametrize("extra", [{"store": True}, {"store": False},
                                   {"metadata": {"team": "search", "run": "7"}},
                                   {"parallel_tool_calls": False}, {"metadata": None}])
def test_fields_that_change_nothing_are_accepted_when_well_formed(extra):
    params = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         **extra})
    assert params.params.model == "m"


@pytest.mark.parametrize("extra, param", [
    ({"store": "yes"}, "store"), ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"metadata": ["a"]}, "metadata"), ({"metadata": {"k": 5}}, "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata")])
def test_malformed_ignored_fields_are_a_400_naming_them(extra, param):
    with pytest.raises(InvalidRequest) as refused:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})
    assert refused.value.param == param


@pytest.mark.parametrize("bad", ["x", 0, -3, 1.5])
def test_a_bad_max_tokens_is_refused_even_beside_max_completion_tokens(bad):
    with pytest.raises(InvalidRequest) as refused:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "max_completion_tokens": 5, "max_tokens": bad})
    assert refused.value.param == "max_tokens"


@pytest.mark.parametrize("message, param, code", [
    ({"role": ["user"], "content": "x"}, "messages[0].role", "invalid_value"),
    ({"role": {"a": 1}, "content": "x"}, "messages[0].role", "invalid_value"),
    ({"role": "user", "content": "\ud800"}, "messages[0].content", "invalid_value"),
    ({"role": "user", "content": "a\x00b"}, "messages[0].content", "invalid_value"),
    ({"role": "user", "content": [{"type": "text", "text": "\udfff"}]}, "messages[0].content",
     "invalid_value"),
    ({"role": "user", "content": "x", "colour": "red"}, "messages[0].colour",
     "unknown_parameter"),
    ({"role": "user"}, "messages[0].content", "missing_required_parameter"),
    ({"role": "user", "content": "x", "name": 5}, "messages[0].name", "invalid_type"),
])
def test_a_malformed_message_is_a_400_naming_the_field_inside_it(message, param, code):
    with pytest.raises(InvalidRequest) as refused:
        parse_chat({"model": "m", "messages": [message]})
    assert (refused.value.param, refused.value.code) == (param, code)


def test_tool_turns_reach_the_template_and_sdk_extras_are_ignored():
    replayed = {"role": "assistant", "content": None, "refusal": None, "name": "bot",
                "annotations": [], "audio": None, "parsed": None,
                "tool_calls": [{"id": "c1", "type": "function", "index": 0,
                                "function": {"name": "f", "arguments": "{}",
                                             "parsed_arguments": {}}}]}
    req = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, replayed,
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]})
    assert req.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]


def test_prompts_times_choices_are_bounded():
    with pytest.raises(InvalidRequest) as refused:
        parse_completion({"model": "m", "prompt": ["x"] * 5, "n": 13})
    assert refused.value.param == "prompt"
    assert len(parse_completion({"model": "m", "prompt": ["x"] * 4, "n": 16}).prompts) == 4


def test_n_best_of_and_echo_are_parsed_and_checked():
    completion = {"model": "m", "prompt": "x"}
    p = parse_completion({**completion, "n": 3, "best_of": 5, "echo": True}).params
    assert (p.n, p.best_of, p.echo) == (3, 5, True)
    assert parse_chat({**CHAT, "n": 4}).params.best_of == 4
    # The prompt's logprobs the engine computes: the echoed prompt's, or vLLM's, the most.
    scored = parse_completion({**completion, "echo": True, "logprobs": 2,
                               "prompt_logprobs": 5}).params
    assert (scored.prompt_logprobs, scored.prompt_top) == (5, 5)
    assert parse_completion({**completion, "echo": True, "logprobs": 3}).params.prompt_top == 3
    assert parse_completion({**completion, "logprobs": 3}).params.prompt_top is None
    for extra, param in (({"n": 2, "best_of": 1}, "best_of"),
                         ({"best_of": 2, "stream": True}, "best_of"),
                         ({"echo": True, "logprobs": 1, "stream": True}, "stream"),
                         ({"prompt_logprobs": 1, "stream": True}, "stream"),
                         ({"n": 17}, "n"), ({"suffix": "x"}, "suffix")):
        with pytest.raises(InvalidRequest) as refused:
            parse_completion({**completion, **extra})
        assert refused.value.param == param


@pytest.mark.parametrize("patch, param", [
    ({"model": "m\x00"}, "model"), ({"stop": ["\ud800"]}, "stop"), ({"user": "\x00"}, "user"),
    ({"metadata": {"k": "\udc00"}}, "metadata"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("inf")}, "top_p"), ({"temperature": True}, "temperature"),
])
def test_text_and_numbers_that_would_break_the_tokenizer_or_database_are_refused(patch, param):
    with pytest.raises(InvalidRequest) as refused:
        parse_chat({**CHAT, **patch})
    assert refused.value.param == param


def test_a_completion_prompt_with_a_lone_surrogate_or_nul_is_refused():
    for prompt in ["\ud800", "a\x00", ["\udbff"]]:
        with pytest.raises(InvalidRequest) as refused:
            parse_completion({"model": "m", "prompt": prompt})
        assert (refused.value.param, refused.value.code) == ("prompt", "invalid_value")


def test_a_body_nested_deeper_than_the_limit_is_refused_before_validation():
    from inference.params import MAX_NESTING

    deep: object = "x"
    for _ in range(MAX_NESTING + 1):
        deep = [deep]
    with pytest.raises(InvalidRequest, match="nests more than"):
        parse_chat({**CHAT, "metadata": {"k": deep}})
    very_deep: object = []
    for _ in range(50_000):  # deeper than the interpreter's stack: refused, not a crash
        very_deep = [very_deep]
    with pytest.raises(InvalidRequest):
        parse_chat({**CHAT, "tools": very_deep})


def test_logprobs_off_is_accepted_and_asks_for_none():
    assert parse_chat({**CHAT, "logprobs": False}).params.logprobs is None
    assert parse_chat({**CHAT, "logprobs": True}).params.logprobs == 0
    assert parse_chat({**CHAT, "logprobs": True, "top_logprobs": 5}).params.logprobs == 5
    completion = {"model": "m", "prompt": "x"}
    assert parse_completion({**completion, "logprobs": 0}).params.logprobs == 0
    assert parse_completion(completion).params.logprobs is None
    with pytest.raises(InvalidRequest):
        parse_completion({**completion, "logprobs": True})


def test_sampling_controls_are_parsed():
    p = parse_chat({**CHAT, "presence_penalty": -0.5, "frequency_penalty": 1,
                    "repetition_penalty": 1.2, "logit_bias": {"0012": 5, "7": -100},
                    "min_tokens": 3, "ignore_eos": True, "stop_token_ids": [2, 9]}).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias,
            p.min_tokens, p.ignore_eos, p.stop_token_ids) == \
        (-0.5, 1.0, 1.2, {"12": 5.0, "7": -100.0}, 3, True, [2, 9])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
FIELD = st.sampled_from(sorted(CHAT_FIELDS | COMPLETION_FIELDS) + ["role", "content", "x"])
MESSAGE = st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls", "x"]),
                          JSON | st.sampled_from(["user", "assistant", "\ud800", "a\x00"]),
                          max_size=4)
BODY = st.fixed_dictionaries(
    {}, optional={"model": st.text(max_size=4) | JSON, "messages": st.lists(MESSAGE | JSON,
                                                                            max_size=3) | JSON,
                  "prompt": st.text(max_size=8) | st.lists(st.integers(), max_size=3) | JSON},
).flatmap(lambda base: st.dictionaries(FIELD, JSON, max_size=4).map(lambda e: {**e, **base}))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODY, chat=st.booleans())
def test_any_json_body_either_parses_or_is_a_400_naming_a_parameter(body, chat):
    """The property the HTTP and websocket entry points rely on: no other exception."""
    try:
        parsed = parse_chat(body) if chat else parse_completion(body)
    except InvalidRequest as refused:
        assert refused.status == 400 and refused.code
        assert refused.param is None or isinstance(refused.param, str)
        return
    text = [m["content"] for m in parsed.messages] if chat else parsed.prompts
    for piece in [parsed.params.model, *parsed.params.stop, *text]:
        if isinstance(piece, str):
            assert "\x00" not in piece
            piece.encode("utf-8")
