"""The Llama family (Llama, Mistral, Qwen2) forward pass over a paged KV cache.

Tokens of every scheduled sequence are flattened into one batch [tokens, hidden];
only attention needs to know where one sequence ends (``AttentionMetadata``).
Q/K/V and gate/up projections are fused into one matmul each at load time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, paged_attention
from engine.layers.rotary import RotaryEmbedding, rope_parameters

if TYPE_CHECKING:
    from engine.lora.manager import LoRABatch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"activation {raw['hidden_act']!r} is not supported (silu only)")
        rope_parameters(raw)  # raises on what it cannot do
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        is_qwen2 = raw.get("model_type") == "qwen2" or arch == "Qwen2ForCausalLM"
        window = raw.get("sliding_window")
        max_len = raw["max_position_embeddings"]
        if window and (raw.get("use_sliding_window", True) if is_qwen2 else True):
            # NOTE: attention here is always full; a context no longer than the window
            # makes that exact, so the window caps the context instead.
            max_len = min(max_len, window)
        return cls(
            raw=raw, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
            num_heads=heads, num_kv_heads=kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), max_position_embeddings=max_len,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", is_qwen2)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata, lora: LoRABatch | None) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [tokens, q_size + 2 * kv_size]
        if lora is not None:
            lora.apply(self.layer, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        out = out.reshape(tokens, self.q_size)
        y = self.o_proj(out)
        return y if lora is None else lora.apply(self.layer, "o", out, y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size,
                                      bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [tokens, 2 * intermediate]
        if lora is not None:
            lora.apply(self.layer, "gate_up", x, gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        h = F.silu(gate) * up
        y = self.down_proj(h)
        return y if lora is None else lora.apply(self.layer, "down", h, y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata, lora: LoRABatch | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.raw, cfg.head_dim,
                                 max_positions or cfg.max_position_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """input_ids, positions [tokens] -> final hidden states [tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, kv_cache, meta, lora)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> float32 logits [rows, vocab]."""
        return self.lm_head(hidden).float()
