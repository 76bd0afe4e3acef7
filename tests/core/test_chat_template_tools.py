"""Tools reach the model through its chat template, exactly as transformers renders them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.served_models import ServedModel, load_served_model
from engine import demo_model

# The demo template before tools, byte for byte: the demo weights are trained on its output.
OLD_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Sure? ünïcødé 🚀"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""},
     {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "{{ not jinja }} <tool_call>\n{\"name\": \"x\"}</tool_call>"},
     {"role": "system", "content": "a second system message, mid-way"},
     {"role": "assistant", "content": "  spaces\n\nand lines  "}],
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time (UTC) ☀"}},
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "{\"temp_c\": 21}"},
    {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
    {"role": "assistant", "content": "21 °C at noon."},
    {"role": "user", "content": "And London?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_c", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"London\"}"}}]},
    {"role": "tool", "tool_call_id": "call_c", "content": "{\"temp_c\": 15}"},
]


def _with_dict_arguments(messages: list[dict]) -> list[dict]:
    """What a transformers user passes: arguments as dicts ("" meaning no arguments)."""
    converted = json.loads(json.dumps(messages))
    for message in converted:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"] or "{}")
    return converted


def _variant(base: Path, tmp_path: Path, name: str, **tok_config: object) -> Path:
    """A copy of the tiny model whose tokenizer_config.json differs as given (None deletes)."""
    path = tmp_path / name
    shutil.copytree(base, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    for key, value in tok_config.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "tokenizer_config.json").chmod(0o644)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def served(tiny_model_path: Path) -> ServedModel:
    return load_served_model(tiny_model_path, "tiny")


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def old_served(tiny_model_path: Path, tmp_path: Path) -> ServedModel:
    return load_served_model(_variant(tiny_model_path, tmp_path, "old", chat_template=OLD_TEMPLATE),
                             "old")


@pytest.mark.parametrize("messages", PLAIN_CONVERSATIONS)
def test_plain_conversations_render_byte_identical_to_the_old_template(served, old_served,
                                                                       messages):
    assert served.render_chat(messages) == old_served.render_chat(messages)


role = st.sampled_from(["system", "user", "assistant"])
text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.fixed_dictionaries({"role": role, "content": text}), min_size=1, max_size=6),
       st.booleans())
def test_any_plain_conversation_renders_as_before_with_and_without_trim_blocks(messages, prompt):
    # NOTE: the training corpus renders through a plain Environment (no trim_blocks).
    for env in (jinja2.Environment(),
                jinja2.Environment(trim_blocks=True, lstrip_blocks=True)):
        old = env.from_string(OLD_TEMPLATE).render(messages=messages, bos_token="<s>",
                                                   add_generation_prompt=prompt)
        new = env.from_string(demo_model.CHAT_TEMPLATE).render(
            messages=messages, bos_token="<s>", add_generation_prompt=prompt)
        assert new == old


def test_the_demo_training_stream_is_unchanged(monkeypatch, tiny_model_path: Path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    new = demo_model._training_tokens(tokenizer, 0)
    monkeypatch.setattr(demo_model, "CHAT_TEMPLATE", OLD_TEMPLATE)
    assert demo_model._training_tokens(tokenizer, 0) == new


def test_rendering_with_tools_lists_every_tool_and_each_call_and_response(served):
    text = served.render_chat(TOOL_CONVERSATION, tools=TOOLS)
    assert text.count("<|system|>") == 1 and "Be brief." in text
    tools_block = text[text.index("<tools>\n"):text.index("\n</tools>")]
    assert [json.loads(line) for line in tools_block.splitlines()[1:]] == TOOLS
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|end|>' in text
    assert "<|assistant|>\nChecking.\n<tool_call>\n" in text
    assert ("<|user|>\n<tool_response>\n{\"temp_c\": 21}\n</tool_response>\n"
            "<tool_response>\n12:00\n</tool_response><|end|>\n") in text
    assert text.endswith("</tool_response><|end|>\n<|assistant|>\n")


@pytest.mark.parametrize("messages", [TOOL_CONVERSATION, TOOL_CONVERSATION[1:],
                                      TOOL_CONVERSATION[:2]])
def test_rendering_with_tools_equals_apply_chat_template(served, hf_tokenizer, messages):
    expected = hf_tokenizer.apply_chat_template(_with_dict_arguments(messages), tools=TOOLS,
                                                tokenize=False, add_generation_prompt=True)
    assert served.render_chat(messages, tools=TOOLS) == expected
    assert served.encode_chat(messages, tools=TOOLS) == hf_tokenizer.apply_chat_template(
        _with_dict_arguments(messages), tools=TOOLS, add_generation_prompt=True,
        return_dict=False)


def test_tool_calls_and_tool_messages_render_without_tools_too(served, hf_tokenizer):
    expected = hf_tokenizer.apply_chat_template(_with_dict_arguments(TOOL_CONVERSATION),
                                                tokenize=False, add_generation_prompt=True)
    assert served.render_chat(TOOL_CONVERSATION) == expected
    assert "<tools>" not in expected


def test_arguments_that_are_not_a_json_object_render_as_sent(served):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [
                    {"id": "c", "type": "function",
                     "function": {"name": "now", "arguments": "not json"}}]}]
    assert '{"name": "now", "arguments": not json}' in served.render_chat(messages)


def test_rendering_leaves_the_callers_messages_alone(served):
    messages = json.loads(json.dumps(TOOL_CONVERSATION))
    served.render_chat(messages, tools=TOOLS)
    assert messages == TOOL_CONVERSATION


def test_the_demo_model_declares_the_hermes_format(served, tiny_model_path: Path):
    config = json.loads((tiny_model_path / "tokenizer_config.json").read_text())
    assert config["tool_parser"] == "hermes" == served.tool_format


LLAMA3_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                   "{% if tools %}Respond as {\"name\": function name, \"parameters\": "
                   "dictionary of argument name and its value}.{% endif %}")


@pytest.mark.parametrize("tok_config, expected", [
    ({"tool_parser": None}, "hermes"),  # inferred: the template writes <tool_call>
    ({"tool_parser": "llama3_json"}, "llama3_json"),
    ({"tool_parser": None, "chat_template": LLAMA3_TEMPLATE}, "llama3_json"),
    ({"tool_parser": None, "chat_template": "<|python_tag|>{{ messages }}"}, "llama3_json"),
    ({"tool_parser": None, "chat_template": OLD_TEMPLATE}, None),
    ({"tool_parser": None, "chat_template": []}, None),
])
def test_the_tool_format_comes_from_the_declaration_else_the_template(
        tiny_model_path, tmp_path, tok_config, expected):
    path = _variant(tiny_model_path, tmp_path, "variant", **tok_config)
    assert load_served_model(path, "variant").tool_format == expected


def test_declaring_tool_parser_null_says_the_model_cannot_call_tools(tiny_model_path, tmp_path):
    path = _variant(tiny_model_path, tmp_path, "declared", tool_parser="x")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["tool_parser"] = None
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_served_model(path, "declared").tool_format is None


def test_a_named_tool_use_template_is_used_when_tools_are_given(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    tool_use = "TOOLS{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<tool_call>"
    path = _variant(tiny_model_path, tmp_path, "named", tool_parser=None, chat_template=[
        {"name": "default", "template": OLD_TEMPLATE}, {"name": "tool_use", "template": tool_use}])
    ours, hf = load_served_model(path, "named"), AutoTokenizer.from_pretrained(path)
    messages = TOOL_CONVERSATION[:2]
    for tools in (None, TOOLS):
        assert ours.render_chat(messages, tools=tools) == hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages, tools=TOOLS) == "TOOLS get_weather now<tool_call>"
    assert ours.tool_format == "hermes"


def test_unknown_roles_are_still_refused(served):
    from core.served_models import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="roles must be"):
        served.render_chat([{"role": "robot", "content": "x"}])
