"""The Llama family (Llama, Mistral, Qwen2) forward pass over a paged KV cache.

Tokens of every scheduled sequence are flattened into one batch [tokens, hidden];
only attention needs to know where one sequence ends (``AttentionMetadata``).
Q/K/V and gate/up projections are fused into one matmul each at load time.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, paged_attention
from engine.layers.rotary import RotaryEmbedding
from engine.models.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.lora.manager import LoRABatch


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int,
                 **factory) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias, **factory)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False, **factory)
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
    def __init__(self, cfg: ModelConfig, layer: int, **factory) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size,
                                      bias=cfg.mlp_bias, **factory)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                                   **factory)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [tokens, 2 * intermediate]
        if lora is not None:
            lora.apply(self.layer, "gate_up", x, gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        h = F.silu(gate) * up
        y = self.down_proj(h)
        return y if lora is None else lora.apply(self.layer, "down", h, y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int,
                 **factory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.self_attn = Attention(cfg, rotary, layer, **factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.mlp = MLP(cfg, layer, **factory)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata, lora: LoRABatch | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 with_lm_head: bool = True) -> None:
        """Parameters are made in ``dtype`` on ``device`` (torch's defaults when None);
        nothing global (torch's default dtype or device) is touched. Without
        ``with_lm_head`` (an embedding model) it computes no logits."""
        super().__init__()
        self.config = cfg
        factory = {"dtype": dtype, "device": device}
        # NOTE: the rotary tables are computed on the device itself, as transformers does
        # (a scoped device context: restored on exit, thread-local).
        with torch.device(device) if device is not None else contextlib.nullcontext():
            rotary = RotaryEmbedding(cfg.raw, cfg.head_dim,
                                     max_positions or cfg.max_position_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, i, **factory)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **factory) \
            if with_lm_head else None

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
