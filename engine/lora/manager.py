"""LoRA weights on the device: every adapter slot stacked per layer and projection.

For each layer and each fused projection (qkv, o, gate_up, down) the manager holds
``lora_a [slots, slices * R, in]`` and ``lora_b [slots, out, R]`` padded with zeros to
the maximum rank R, the per-slot scalings ``[slots, slices]`` and ranks ``[slots]``.
``apply`` adds the LoRA term of every adapter row of a step to a projection's output
with one SGMV shrink and one expand (Triton, on CUDA).

On CPU the manager keeps a second, compact copy of each slot: ``A [slices * rank, in]``
at the adapter's own rank and ``B`` as one block-diagonal ``[slices * rank, out]`` with
the scalings folded in, so each segment costs two matmuls whatever the slice count.
With several segments of similar length (a decode step over a few adapters), the step
instead pads the segments to one length and runs two batched matmuls over them, with
the slots' compact weights stacked once per set of slots and reused while the set
lasts: the cost no longer grows with one small matmul per segment. That is the engine's
CPU path; the SGMV references stay the kernels' oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.sgmv import (
    Segments,
    sgmv_expand,
    sgmv_expand_reference,
    sgmv_shrink,
    sgmv_shrink_reference,
)
from engine.lora.adapter import TARGETS, LoRAAdapter, module_shapes
from engine.models.model_config import ModelConfig

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
        # The compact copies of a tuple of slots stacked for batched matmuls:
        # (A [n, in, R], B [n, R, out]) with R the largest slices * rank among them.
        self.stacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def stacked_for(self, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        found = self.stacked.get(slots)
        if found is None:
            if len(self.stacked) >= _STACKS_KEPT:
                self.stacked.pop(next(iter(self.stacked)))
            width = max(self.dense[s][0].shape[0] for s in slots)
            a0, b0 = self.dense[slots[0]]
            a = torch.zeros(len(slots), a0.shape[1], width, dtype=a0.dtype, device=a0.device)
            b = torch.zeros(len(slots), width, b0.shape[1], dtype=b0.dtype, device=b0.device)
            for i, slot in enumerate(slots):
                da, db = self.dense[slot]
                a[i, :, :da.shape[0]] = da.T
                b[i, :db.shape[0]] = db
            found = self.stacked[slots] = (a, b)
        return found


# Sets of slots whose stacked weights a projection keeps (a decode batch keeps one set
# for many steps; a few cover the sets that alternate as requests come and go).
_STACKS_KEPT = 4
# The batched CPU path runs when a step has at least this many segments and padding
# them to the longest adds at most as many rows again.
_BATCH_FROM_SEGMENTS = 3


@dataclass(slots=True)
class CpuPlan:
    """How one step's segments run on the CPU path, worked out once for all layers."""

    segments: list[tuple[int, int, int]]  # (start, length, slot)
    slots: tuple[int, ...] = ()  # batched: the segments' slots, in order
    length: int = 0  # batched: rows per padded segment
    gather: torch.Tensor | None = None  # [segments * length] rows of x (pads repeat a row)
    rows: torch.Tensor | None = None  # the real rows among them, where results are added
    real: torch.Tensor | None = None  # positions of the real rows in the padded layout

    @classmethod
    def of(cls, seg: Segments) -> CpuPlan:
        segments = seg.as_list()
        plan = cls(segments)
        if len(segments) < _BATCH_FROM_SEGMENTS:
            return plan
        length = max(n for _, n, _ in segments)
        total = sum(n for _, n, _ in segments)
        if length * len(segments) > 2 * total:
            return plan  # one long prompt chunk among short rows: padding would dominate
        gather, real = [], []
        for i, (start, n, _) in enumerate(segments):
            gather += list(range(start, start + n)) + [start] * (length - n)
            real += range(i * length, i * length + n)
        plan.slots = tuple(slot for _, _, slot in segments)
        plan.length = length
        plan.gather = torch.tensor(gather, device=seg.starts.device)
        plan.rows = plan.gather[torch.tensor(real, device=seg.starts.device)]
        plan.real = None if len(real) == len(gather) else torch.tensor(real,
                                                                      device=seg.starts.device)
        return plan


def apply_batched(x: torch.Tensor, y: torch.Tensor, plan: CpuPlan, a: torch.Tensor,
                  b: torch.Tensor) -> None:
    """y += the LoRA term of a batched plan's rows; a [n, in, R] and b [n, R, out] are the
    plan's slots' compact weights, stacked."""
    padded = x.index_select(0, plan.gather).view(len(plan.slots), plan.length, -1)
    out = torch.bmm(torch.bmm(padded, a), b).view(-1, b.shape[2])
    if plan.real is not None:
        out = out.index_select(0, plan.real)
    y.index_add_(0, plan.rows, out)


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
                # Stacks holding this slot's old weights are dropped (all: few, and cheap).
                stack.stacked.clear()
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
              seg: Segments, plan: CpuPlan | None = None) -> None:
        """y [tokens, out] += the LoRA term of x [tokens, in] for every adapter row."""
        stack = self.stacks[layer][proj]
        if not self.use_triton:
            plan = plan or CpuPlan.of(seg)
            if plan.gather is None:
                for start, length, slot in plan.segments:
                    a, b = stack.dense[slot]
                    rows = slice(start, start + length)
                    y[rows].addmm_(x[rows] @ a.T, b)  # [n, slices * rank] @ [.., out]
                return
            apply_batched(x, y, plan, *stack.stacked_for(plan.slots))
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
        self.plan = None if manager.use_triton else CpuPlan.of(segments)

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.manager.apply(layer, proj, x, y, self.segments, self.plan)
        return y
