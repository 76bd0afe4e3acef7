"""Loads Hugging Face safetensors checkpoints (one file or sharded) into the engine's model.

Only safetensors are read: a pickle (``*.bin``) can run code when loaded, so it is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Checkpoint names fused into one engine parameter: name -> (fused name, slice index).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    if any(model_dir.glob("*.bin")):
        raise ValueError(f"{model_dir} holds pickled weights (*.bin); only safetensors are "
                         f"loaded, since unpickling can run arbitrary code")
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    """Copies every checkpoint tensor into its place; fails on anything missing or extra."""
    params = dict(model.named_parameters())
    cfg = model.config
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    offsets = {"self_attn.qkv_proj": [0, q, q + kv], "mlp.gate_up_proj": [0, inter]}
    seen: set[str] = set()
    for name, tensor in iter_tensors(model_dir):
        # NOTE: an embedding model computes no logits: its lm_head, if any, is not loaded.
        if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and model.lm_head is None):
            continue
        if name.startswith(("embed_tokens.", "layers.", "norm.")):
            name = f"model.{name}"  # a base model's checkpoint (LlamaModel): no prefix
        target, rows = _target(name, offsets)
        if target is None or target not in params:
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
        param = params[target]
        dest = param.data if rows is None else param.data[rows[0]:rows[0] + tensor.shape[0]]
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        seen.add(name)
    if cfg.tie_word_embeddings and model.lm_head is not None and "lm_head.weight" not in seen:
        model.lm_head.weight = model.embed_tokens.weight
        seen.add("lm_head.weight")
    expected = _expected_names(model)
    missing = expected - seen
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _target(name: str, offsets: dict[str, list[int]]) -> tuple[str | None, tuple[int] | None]:
    if name.startswith("model.") and not name.startswith("model.layers."):
        return name.removeprefix("model."), None
    if name == "lm_head.weight":
        return name, None
    match = _LAYER.match(name)
    if match is None:
        return None, None
    layer, rest = match.groups()
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused, index = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", (offsets[fused][index],)
    return f"layers.{layer}.{rest}", None


def _expected_names(model: LlamaForCausalLM) -> set[str]:
    """The checkpoint names the model needs, with fused parameters split back."""
    unfused = {v[0]: [k for k, w in _FUSED.items() if w[0] == v[0]] for v in _FUSED.values()}
    names = set()
    for name, _ in model.named_parameters():
        match = re.match(r"^layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if match and match.group(2) in unfused:
            layer, module, kind = match.groups()
            names.update(f"model.layers.{layer}.{part}.{kind}" for part in unfused[module])
        elif name == "lm_head.weight":
            names.add(name)
        else:
            names.add(f"model.{name}")
    return names
