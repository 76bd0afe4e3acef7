"""Request validation: every bad field is a 400 naming the parameter."""

import pytest

from inference.errors import InvalidRequest
from inference.params import parse_chat, parse_completion

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
    ({"n": 2}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"tools": [{"type": "function"}]}, "tools"),
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
    ("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5]),
])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion({"model": "m", "prompt": prompt}).prompt == expected


@pytest.mark.parametrize("prompt", [None, 5, [], ["a", "b"], [1, -2], [1.5]])
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
