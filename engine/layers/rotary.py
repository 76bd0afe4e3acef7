"""Rotary position embeddings (RoPE) with the scalings Llama-family checkpoints use.

``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (earlier
releases) from config.json; types: default, linear, llama3, yarn.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """One dict with ``rope_type`` and ``rope_theta``, whichever way config.json spells it."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] not in SUPPORTED:
        raise ValueError(f"RoPE type {params['rope_type']!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    return params


def inverse_frequencies(params: dict[str, Any], head_dim: int,
                        max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Per-pair rotation speeds [head_dim // 2] and the factor cos/sin are scaled by."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / base ** exponents
    kind = params["rope_type"]
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, params, head_dim, max_position_embeddings)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    blend = (old_len / wavelen - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, slowed)


def _yarn(inv_freq: torch.Tensor, p: dict[str, Any], head_dim: int,
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = float(p["rope_theta"])
    old_len = p.get("original_max_position_embeddings") or max_position_embeddings
    factor = p.get("factor") or max_position_embeddings / old_len
    if p.get("original_max_position_embeddings"):
        factor = max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def dim_for(rotations: float) -> float:  # the pair index that turns `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(p.get("beta_fast") or 32), dim_for(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged), 0: interpolate (slowed by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: dict[str, Any], head_dim: int, max_positions: int) -> None:
        super().__init__()
        params = rope_parameters(config)
        inv_freq, scale = inverse_frequencies(params, head_dim,
                                              config["max_position_embeddings"])
        # NOTE: float32 throughout, as transformers computes it, so angles match bit for bit.
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.float())  # [max_positions, head_dim // 2]
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)
        # The last step's positions and their rows of the tables: every layer rotates by the
        # same positions tensor, so its rows are looked up once a step.
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] rotated by position."""
        if self._rows is None or self._rows[0] is not positions:
            self._rows = (positions, self.cos[positions].unsqueeze(1),  # [tokens, 1, dim // 2]
                          self.sin[positions].unsqueeze(1))
        _, cos, sin = self._rows
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The "rotate half" layout: pair i is (x[i], x[i + head_dim / 2]).
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
