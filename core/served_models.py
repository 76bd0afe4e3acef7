"""The models this deployment serves, with the tokenizer files the engines use.

The platform tokenizes with the `tokenizers` library and renders chat templates
with a sandboxed Jinja environment configured as Hugging Face does, so prompts
are identical to what transformers would produce, without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False)


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

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(f"model {self.name!r} has no chat template")
        return self.chat_template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # NOTE: the template already writes BOS; adding special tokens again would double it.
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids

    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def load_served_model(path: Path, name: str) -> ServedModel:
    config = json.loads((path / "config.json").read_text())
    tok_config_path = path / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.exists() else {}
    template_source = tok_config.get("chat_template")
    if isinstance(template_source, list):  # named templates: use the default one
        template_source = next((t["template"] for t in template_source
                                if t.get("name") == "default"), None)
    template = None
    if template_source:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        template = env.from_string(template_source)
    context = context_window(config)
    model_max = tok_config.get("model_max_length")
    if isinstance(model_max, int) and 0 < model_max < context:
        context = model_max
    return ServedModel(
        name=name,
        path=path,
        context_window=context,
        tokenizer=Tokenizer.from_file(str(path / "tokenizer.json")),
        chat_template=template,
        bos_token=_special(tok_config, "bos_token"),
        eos_token=_special(tok_config, "eos_token"),
        created=int((path / "config.json").stat().st_mtime),
    )


def model_path_and_name() -> tuple[Path, str]:
    """Where the served model lives and what clients call it."""
    if settings.ATRIUM_MODEL:
        path = Path(settings.ATRIUM_MODEL).expanduser().resolve()
        return path, settings.ATRIUM_MODEL_NAME or path.name
    from engine.demo_model import ensure_demo_model  # builds once, then only a path lookup

    return ensure_demo_model(settings.ATRIUM_HOME), settings.ATRIUM_MODEL_NAME or DEMO_MODEL_NAME


@cache
def served_models() -> dict[str, ServedModel]:
    path, name = model_path_and_name()
    return {name: load_served_model(path, name)}
