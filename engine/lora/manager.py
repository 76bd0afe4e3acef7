"""LoRA weights on the device: every adapter slot stacked per layer and projection.

For each layer and each fused projection (qkv, o, gate_up, down) the manager holds
``lora_a [slots, slices * R, in]`` and ``lora_b [slots, out, R]`` padded with zeros to
the maximum rank R, the per-slot scalings ``[slots, slices]`` and ranks ``[slots]``.
``apply`` adds the LoRA term of every adapter row of a step to a projection's output
with one SGMV shrink and one expand (Triton, on CUDA).

On CPU the manager keeps a second, compact copy of each slot: ``A [slices * rank, in]``
at the adapter's own rank and ``B`` as one block-diagonal ``[slices * rank, out]`` with
the scalings folded in, so each segment costs two matmuls whatever the slice count.
That is the engine's CPU path; the SGMV references stay the kernels' oracle.
"""

from __future__ import annotations

import torch

from engine.kernels.sgmv import (
    Segments,
    sgmv_expand,
    sgmv_expand_reference,
    sgmv_shrink,
    sgmv_shrink_reference,
)
from engine.lora.adapter import TARGETS, LoRAAdapter, module_shapes
from engine.models.llama import ModelConfig

# Each fused projection and the checkpoint modules that are its slices, in order.
PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
               "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class _Stack:
    def __init__(self, slots: int, modules: tuple[str, ...], shapes: dict[str, tuple[int, int]],
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        in_features = shapes[modules[0]][0]
        self.offsets = [0]
        for name in modules:
            self.offsets.append(self.offsets[-1] + shapes[name][1])
        self.a = torch.zeros(slots, len(modules) * max_rank, in_features, dtype=dtype,
                             device=device)
        self.b = torch.zeros(slots, self.offsets[-1], max_rank, dtype=dtype, device=device)
        self.scales = torch.zeros(slots, len(modules), dtype=torch.float32, device=device)
        # The CPU path's compact copies, per slot (see the module docstring).
        self.dense: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * slots


class LoRAManager:
    def __init__(self, model: ModelConfig, *, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, use_triton: bool) -> None:
        self.max_rank = max_rank
        self.use_triton = use_triton
        shapes = module_shapes(model)
        self.stacks = [{proj: _Stack(num_slots, modules, shapes, max_rank, dtype, device)
                        for proj, modules in PROJECTIONS.items()}
                       for _ in range(model.num_layers)]
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.slot_hash: list[str | None] = [None] * num_slots

    def load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copies an adapter's weights into ``slot`` (zeros where it adapts nothing).

        ``slot_hash[slot]`` names the adapter only once the copy is complete: after a copy
        that failed part-way it is None, never the previous adapter's hash.
        """
        self.slot_hash[slot] = None
        r = self.max_rank
        for layer in self.stacks:
            for stack in layer.values():
                stack.a[slot].zero_()
                stack.b[slot].zero_()
                stack.scales[slot].zero_()
        for (layer, module), weights in adapter.modules.items():
            proj, index = TARGETS[module]
            stack = self.stacks[layer][proj]
            rank = weights.a.shape[0]
            lo, hi = stack.offsets[index], stack.offsets[index + 1]
            stack.a[slot, index * r:index * r + rank] = weights.a
            stack.b[slot, lo:hi, :rank] = weights.b
            stack.scales[slot, index] = weights.scaling
        self.ranks[slot] = adapter.rank
        if not self.use_triton:
            rank = adapter.rank
            for layer in self.stacks:
                for stack in layer.values():
                    slices = stack.scales.shape[1]
                    a = stack.a[slot].view(slices, r, -1)[:, :rank].reshape(slices * rank, -1)
                    b = torch.zeros(slices * rank, stack.offsets[-1], dtype=stack.b.dtype,
                                    device=stack.b.device)
                    for s in range(slices):
                        lo, hi = stack.offsets[s], stack.offsets[s + 1]
                        b[s * rank:(s + 1) * rank, lo:hi] = \
                            (stack.b[slot, lo:hi, :rank] * stack.scales[slot, s]).T
                    stack.dense[slot] = (a.contiguous(), b)
        self.slot_hash[slot] = adapter.adapter_hash

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor,
              seg: Segments) -> None:
        """y [tokens, out] += the LoRA term of x [tokens, in] for every adapter row."""
        stack = self.stacks[layer][proj]
        if not self.use_triton:
            for start, length, slot in seg.as_list():
                a, b = stack.dense[slot]
                rows = slice(start, start + length)
                y[rows].addmm_(x[rows] @ a.T, b)  # [n, slices * rank] @ [.., out]
            return
        buf = torch.empty(x.shape[0], stack.a.shape[1], dtype=torch.float32, device=x.device)
        shrink, expand = (sgmv_shrink, sgmv_expand) if self.use_triton \
            else (sgmv_shrink_reference, sgmv_expand_reference)
        shrink(x, stack.a, buf, seg, self.ranks, self.max_rank)
        expand(buf, stack.b, y, seg, self.ranks, self.max_rank, stack.offsets, stack.scales)


class LoRABatch:
    """One step's adapter rows: what the model's layers need to apply LoRA."""

    def __init__(self, manager: LoRAManager, segments: Segments) -> None:
        self.manager = manager
        self.segments = segments

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.manager.apply(layer, proj, x, y, self.segments)
        return y
