"""What the forward pass needs from a checkpoint's config.json, read and checked once.

Its own module because more than the model reads it: the LoRA loader and manager size
their weights from it, and the runner sizes the KV cache from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.layers.rotary import rope_parameters
from engine.models.context import context_window

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# The same models without a language-model head (transformers' base classes), as
# sentence-transformers saves an embedding model: they embed, never generate.
BASE_ARCHITECTURES = ("LlamaModel", "MistralModel", "Qwen2Model")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the forward pass needs from config.json, checked on load."""

    raw: dict[str, Any]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    dtype: str  # the checkpoint's own dtype
    has_lm_head: bool = True  # False: a base model's checkpoint (BASE_ARCHITECTURES)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = (raw.get("architectures") or [""])[0]
        if arch not in SUPPORTED_ARCHITECTURES + BASE_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES + BASE_ARCHITECTURES)})")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"activation {raw['hidden_act']!r} is not supported (silu only)")
        rope_parameters(raw)  # raises on what it cannot do
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        is_qwen2 = raw.get("model_type") == "qwen2" or arch.startswith("Qwen2")
        max_len = context_window(raw)
        return cls(
            raw=raw, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
            num_heads=heads, num_kv_heads=kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), max_position_embeddings=max_len,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", is_qwen2)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            has_lm_head=arch in SUPPORTED_ARCHITECTURES)
