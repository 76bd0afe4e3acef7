"""Loading a PEFT LoRA adapter and checking it against the base model.

Only ``adapter_config.json`` + ``adapter_model.safetensors`` are read: a pickled
``adapter_model.bin`` could run code when loaded, so it is refused, never opened.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex
import torch
from safetensors import safe_open

from engine.lora.store import CONFIG_FILE, WEIGHTS_FILE
from engine.models.model_config import ModelConfig

# Engine module -> (fused projection it is a slice of, slice index).
TARGETS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# Settings that change what the adapter computes, with the only value this engine serves.
_MUST_BE = {
    "use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
    "lora_bias": (False, None), "modules_to_save": (None, []), "layer_replication": (None, []),
    "trainable_token_indices": (None, []), "target_parameters": (None, []),
    "alora_invocation_tokens": (None, []), "use_qalora": (False, None),
}


class AdapterError(ValueError):
    """An adapter this engine cannot serve; the message says why, for a person."""


@dataclass(slots=True)
class LoRAModule:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float


@dataclass(slots=True)
class LoRAAdapter:
    adapter_hash: str
    rank: int  # the largest rank of any module
    modules: dict[tuple[int, str], LoRAModule]  # (layer, "q_proj"...) -> weights

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every projection LoRA may target."""
    h, q, kv, i = (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                   cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_config(adapter_dir: Path) -> dict[str, Any]:
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / WEIGHTS_FILE).is_file():
        if any(adapter_dir.glob("*.bin")):
            raise AdapterError("the adapter's weights are a pickle (.bin); only safetensors "
                               "are accepted, since unpickling can run arbitrary code")
        raise AdapterError(f"{WEIGHTS_FILE} is missing")
    try:
        config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{CONFIG_FILE} is missing") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    return config


def check_config(config: dict[str, Any], *, max_rank: int) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not supported (LORA only)")
    for key, allowed in _MUST_BE.items():
        if config.get(key, allowed[0]) not in allowed:
            raise AdapterError(f"{key}={config[key]!r} is not supported")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"r must be a positive integer, got {r!r}")
    _check_pattern(config, "rank_pattern", kind=int)
    _check_pattern(config, "alpha_pattern", kind=int | float)
    ranks = [r, *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise AdapterError(f"rank {max(ranks)} is above this deployment's maximum of {max_rank}")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise AdapterError(f"lora_alpha must be a positive number, got {alpha!r}")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets
    if not names or not all(isinstance(t, str) for t in names):
        raise AdapterError("target_modules must name the projections to adapt")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) - set(TARGETS))
        if unsupported:
            raise AdapterError(f"target modules {unsupported} are not supported "
                               f"(supported: {', '.join(TARGETS)})")


# A tenant's patterns are regular expressions run by the validation worker: bounded in
# number and length, and each match given a time limit, so no pattern can hang it.
_PATTERN_ENTRIES = 512
_PATTERN_KEY_CHARS = 256
_PATTERN_MATCH_S = 0.05


def _check_pattern(config: dict[str, Any], field: str, *, kind: Any) -> None:
    pattern = config.get(field)
    if pattern is None:
        return
    if not isinstance(pattern, dict):
        raise AdapterError(f"{field} must be an object of module patterns to values")
    if len(pattern) > _PATTERN_ENTRIES:
        raise AdapterError(f"{field} has {len(pattern)} entries; at most {_PATTERN_ENTRIES}")
    for key, value in pattern.items():
        if len(key) > _PATTERN_KEY_CHARS:
            raise AdapterError(f"a {field} key is longer than {_PATTERN_KEY_CHARS} characters")
        if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
            raise AdapterError(f"{field}[{key!r}] must be a positive number, got {value!r}")
        try:
            regex.compile(rf"(.*\.)?{key}")
        except regex.error as exc:
            raise AdapterError(f"{field} key {key!r} is not a valid pattern: {exc}") from None


def _pattern_value(pattern: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern: the first key that is a suffix of the module name,
    or a regular expression matching it."""
    for key, value in (pattern or {}).items():
        if name == key or name.endswith("." + key):
            return value
        try:
            if regex.fullmatch(rf"(.*\.)?{key}", name, timeout=_PATTERN_MATCH_S):
                return value
        except TimeoutError:
            raise AdapterError(f"pattern {key!r} takes too long to match module names; use "
                               "plain module names") from None
    return default


def load_adapter(adapter_dir: Path | str, model: ModelConfig, *, max_rank: int,
                 adapter_hash: str = "", dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Reads and checks an adapter; raises AdapterError with a reason a person understands."""
    adapter_dir = Path(adapter_dir)
    config = read_config(adapter_dir)
    check_config(config, max_rank=max_rank)
    shapes = module_shapes(model)
    halves = _read_halves(adapter_dir / WEIGHTS_FILE, model)
    if not halves:
        raise AdapterError("the adapter holds no LoRA weights")
    modules = {}
    for (layer, module), pair in sorted(halves.items()):
        name = f"model.layers.{layer}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"
        a, b = _checked_pair(name, pair, shapes[module], max_rank)
        rank = a.shape[0]
        alpha = _pattern_value(config.get("alpha_pattern"), name, config.get("lora_alpha", rank))
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[(layer, module)] = LoRAModule(a.to(dtype), b.to(dtype), float(scaling))
    return LoRAAdapter(adapter_hash=adapter_hash,
                       rank=max(m.a.shape[0] for m in modules.values()), modules=modules)

def _read_halves(path: Path, model: ModelConfig) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The file's LoRA tensors by (layer, module), then "A" or "B"."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                match = _KEY.match(key)
                if match is None:
                    raise AdapterError(f"tensor {key!r} is not a LoRA weight of a supported "
                                       f"projection (q/k/v/o/gate/up/down)")
                layer, _, module, half = match.groups()
                if module not in TARGETS:
                    raise AdapterError(f"module {module!r} is not supported")
                if int(layer) >= model.num_layers:
                    raise AdapterError(f"layer {layer} does not exist in the base model "
                                       f"({model.num_layers} layers)")
                halves.setdefault((int(layer), module), {})[half] = f.get_tensor(key)
    except AdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt file must read as a clear refusal
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    return halves


def _checked_pair(name: str, pair: dict[str, torch.Tensor], shape: tuple[int, int],
                  max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A module's A and B, refused unless they pair up, fit the base model and are finite."""
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{name} has lora_{''.join(pair)} without its other half")
    a, b = pair["A"], pair["B"]
    in_features, out_features = shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                           f"do not pair up")
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterError(
            f"{name}: shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not match the base "
            f"model ({in_features} in, {out_features} out); is it for another model?")
    if a.shape[0] > max_rank:
        raise AdapterError(f"{name} has rank {a.shape[0]}, above the maximum of {max_rank}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(f"{name}: weights must be floating point")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{name}: weights hold NaN or infinity")
    return a, b

