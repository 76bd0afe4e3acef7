"""A brief next-token training pass so the demo model babbles English-like text.

Runs on the CPU in seconds; the point is a demo that answers with words and
ends its turn, not a useful model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.demo_spec import ModelSpec


def train(config: dict, tensors: dict[str, torch.Tensor], tokens: list[int], spec: ModelSpec,
          seed: int) -> dict[str, torch.Tensor]:
    """Returns the trained weights under the same names as ``tensors``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_config = LlamaConfig(**{k: v for k, v in config.items()
                                  if k not in ("architectures", "model_type", "torch_dtype")})
    model = LlamaForCausalLM(model_config)
    model.load_state_dict(tensors, strict=True)
    model.train()
    stream = torch.tensor(tokens, dtype=torch.long)  # [num_tokens]
    gen = torch.Generator().manual_seed(seed + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train_lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    warmup = max(1, spec.train_steps // 10)
    seq = spec.train_seq_len
    for step in range(spec.train_steps):
        lr_scale = min(1.0, (step + 1) / warmup) * 0.5 * (
            1 + math.cos(math.pi * step / spec.train_steps))
        for group in opt.param_groups:
            group["lr"] = spec.train_lr * lr_scale
        starts = torch.randint(0, len(stream) - seq - 1, (spec.train_batch,), generator=gen)
        batch = torch.stack([stream[s:s + seq] for s in starts.tolist()])  # [batch, seq]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    state = model.state_dict()
    return {name: state[name].detach().contiguous().clone() for name in tensors}
