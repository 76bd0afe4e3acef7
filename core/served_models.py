"""The models this deployment serves, with the tokenizer files the engines use.

The platform tokenizes with the `tokenizers` library and renders chat templates
with a sandboxed Jinja environment configured as Hugging Face does, so prompts
are identical to what transformers would produce, without importing torch.

Tools reach the model as transformers hands them over: the OpenAI ``tools`` list as
the template's ``tools`` variable, and the ``tool_use`` template of a model that names
one. A model declares how it writes tool calls with ``"tool_parser"`` in its
tokenizer_config.json (vLLM's parser names: ``hermes``, ``llama3_json``); without that
key the format is inferred from the chat template (see ``_tool_format``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from django.conf import settings
from tokenizers import Tokenizer

from engine.models.context import context_window

DEMO_MODEL_NAME = "atrium-demo"


class ChatTemplateError(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' filter, options included: Jinja's own escapes HTML characters."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _special(config: dict, name: str) -> str | None:
    value = config.get(name)
    if isinstance(value, dict):  # AddedToken serialised as a dict
        value = value.get("content")
    return value


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    path: Path
    context_window: int
    tokenizer: Tokenizer
    chat_template: jinja2.Template | None
    bos_token: str | None
    eos_token: str | None
    created: int
    # The name of the format the model writes tool calls in (inference.tools.FORMATS), or
    # None: it cannot call tools unprompted, only under a grammar (tool_choice "required").
    tool_format: str | None = None
    # A named "tool_use" template, which transformers prefers whenever tools are given.
    tool_chat_template: jinja2.Template | None = None
    # What it answers: generation, embeddings, or both (a generative model the operator
    # turned embeddings on for: ATRIUM_EMBEDDING_MODELS). A checkpoint in the
    # sentence-transformers layout embeds only.
    generates: bool = True
    embeds: bool = False
    hidden_size: int = 0  # an embedding's dimensions

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> str:
        """Renders OpenAI-shaped messages (tool_calls, tool messages) with the model's template."""
        template = self.chat_template
        if tools is not None and self.tool_chat_template is not None:
            template = self.tool_chat_template
        if template is None:
            raise ChatTemplateError(f"model {self.name!r} has no chat template")
        return template.render(messages=template_messages(messages), tools=tools, documents=None,
                               add_generation_prompt=True, bos_token=self.bos_token or "",
                               eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        # NOTE: the template already writes BOS; adding special tokens again would double it.
        return self.tokenizer.encode(self.render_chat(messages, tools),
                                     add_special_tokens=False).ids

    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template expects them, as transformers and vLLM hand them over.

    Keys whose value is None are dropped (transformers does: templates test for a missing
    key, and would print "None"). An assistant's ``tool_calls`` carry ``function.arguments``
    as a dict, not OpenAI's JSON string: templates such as Qwen2.5's write
    ``tool_call.arguments | tojson``, which would quote a string a second time. Empty or
    absent arguments become ``{}``; arguments that are not a JSON object stay the string
    the client sent. An empty ``tool_calls`` list is dropped. The caller's dicts are copied.
    """
    converted = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            if calls:
                message["tool_calls"] = [_template_call(call) for call in calls]
            else:
                del message["tool_calls"]
        converted.append(message)
    return converted


def _template_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    return {**call, "function": {**call["function"], "arguments": arguments}}


# Llama 3.1's template asks for `{"name": function name, "parameters": ...}`.
_LLAMA3_PARAMETERS = re.compile(r'\\?"parameters\\?"\s*:')


def _tool_format(tok_config: dict, sources: list[str]) -> str | None:
    """How the model writes tool calls: declared, else recognised in its chat templates.

    ``"tool_parser": null`` in tokenizer_config.json declares that it cannot call tools.
    """
    if "tool_parser" in tok_config:
        declared = tok_config["tool_parser"]
        return declared if isinstance(declared, str) and declared else None
    text = "\n".join(sources)
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or _LLAMA3_PARAMETERS.search(text):
        return "llama3_json"
    return None


def _template_sources(tok_config: dict) -> tuple[str | None, str | None]:
    """The default template and the ``tool_use`` one, where the model names its templates."""
    source = tok_config.get("chat_template")
    if not isinstance(source, list):
        return source or None, None
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    return named.get("default") or None, named.get("tool_use") or None


def _compile(source: str | None) -> jinja2.Template | None:
    if not source:
        return None
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def load_served_model(path: Path, name: str, *, embeds: bool = False) -> ServedModel:
    """``embeds``: a generative model that answers embeddings too."""
    config = json.loads((path / "config.json").read_text())
    tok_config_path = path / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.exists() else {}
    template_source, tool_source = _template_sources(tok_config)
    context = context_window(config)
    model_max = tok_config.get("model_max_length")
    if isinstance(model_max, int) and 0 < model_max < context:
        context = model_max
    return ServedModel(
        name=name,
        path=path,
        context_window=context,
        tokenizer=Tokenizer.from_file(str(path / "tokenizer.json")),
        chat_template=_compile(template_source),
        bos_token=_special(tok_config, "bos_token"),
        eos_token=_special(tok_config, "eos_token"),
        created=int((path / "config.json").stat().st_mtime),
        tool_format=_tool_format(tok_config, [s for s in (template_source, tool_source) if s]),
        tool_chat_template=_compile(tool_source),
        generates=not (path / "modules.json").exists(),
        embeds=embeds or (path / "modules.json").exists(),
        hidden_size=int(config.get("hidden_size") or 0),
    )


def model_paths() -> dict[str, Path]:
    """What clients call each served model, and where it lives: ATRIUM_MODELS (several),
    else ATRIUM_MODEL (one), else the demo model. The first is the default base model."""
    if settings.ATRIUM_MODELS:
        return {name: Path(folder).expanduser().resolve()
                for name, folder in settings.ATRIUM_MODELS.items()}
    if settings.ATRIUM_MODEL:
        path = Path(settings.ATRIUM_MODEL).expanduser().resolve()
        return {settings.ATRIUM_MODEL_NAME or path.name: path}
    from engine.demo_model import ensure_demo_model  # builds once, then only a path lookup

    return {settings.ATRIUM_MODEL_NAME or DEMO_MODEL_NAME: ensure_demo_model(
        settings.ATRIUM_HOME)}


@cache
def served_models() -> dict[str, ServedModel]:
    return {name: load_served_model(path, name, embeds=name in settings.ATRIUM_EMBEDDING_MODELS)
            for name, path in model_paths().items()}
