"""LoRA weights on the device: every adapter slot stacked per layer and projection.

For each layer and each fused projection (qkv, o, gate_up, down) the manager holds
``lora_a [slots, slices * R, in]`` and ``lora_b [slots, out, R]`` padded with zeros to
the maximum rank R, the per-slot scalings ``[slots, slices]`` and ranks ``[slots]``.
``apply`` adds the LoRA term of every adapter row of a step to a projection's output
with one SGMV shrink and one expand (Triton, on CUDA).

On CPU the manager keeps a second, compact copy of the slots, slice-major at each slot's
own rank so that a slot's first ``slices * rank`` columns are its whole adapter:
``A [slots, in, slices * R]`` and ``B [slots, slices * R, out]``, block-diagonal over the
slices with the scalings folded in, so any set of rows costs two matmuls whatever the
slice count; a long segment (a prompt chunk) expands slice by slice instead, over B's
diagonal blocks, skipping the zeros that would double or triple its FLOPs. A step's plan
(``CpuPlan``) runs one-row segments (a decode over many adapters) by slot, as two batched
matmuls over the slots' weights where they lie; similar short segments (a decode over a
few adapters) padded into two batched matmuls over their slots' weights stacked, kept
while the set of slots lasts; and long ones (prompt chunks) one by one. That is the
engine's CPU path; the SGMV references stay the kernels' oracle.
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
                 max_rank: int, dtype: torch.dtype, device: torch.device, compact: bool) -> None:
        in_features = shapes[modules[0]][0]
        self.offsets = [0]
        for name in modules:
            self.offsets.append(self.offsets[-1] + shapes[name][1])
        self.a = torch.zeros(slots, len(modules) * max_rank, in_features, dtype=dtype,
                             device=device)
        self.b = torch.zeros(slots, self.offsets[-1], max_rank, dtype=dtype, device=device)
        self.scales = torch.zeros(slots, len(modules), dtype=torch.float32, device=device)
        # The CPU path's compact copies (see the module docstring): per slot, A [in, W] at
        # W = slices * max_rank, slice-major at the slot's own rank (column s * rank + j is
        # rank j of slice s), so the first slices * rank columns are the adapter's whole A;
        # and B [W, out], block-diagonal over the slices with the scaling in it, so all
        # slices take one matmul. A slot's own width is slices * its rank.
        self.slices = len(modules)
        width = self.slices * max_rank if compact else 0
        self.ua = torch.zeros(slots, in_features, width, dtype=dtype, device=device)
        self.ub = torch.zeros(slots, width, self.offsets[-1], dtype=dtype, device=device)
        self.widths = [0] * slots
        # The compact copies of a tuple of slots stacked for batched matmuls:
        # (A [n, in, W], B [n, W, out]) with W the largest width among them.
        self.stacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def compact(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.widths[slot]
        return self.ua[slot, :, :width], self.ub[slot, :width]

    def expand_by_slice(self, shrunk: torch.Tensor, y: torch.Tensor, slot: int) -> None:
        """y += shrunk [n, slices * rank] @ the slot's B, one diagonal block at a time."""
        rank = self.widths[slot] // self.slices
        for i in range(self.slices):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            y[:, lo:hi].addmm_(shrunk[:, i * rank:(i + 1) * rank],
                               self.ub[slot, i * rank:(i + 1) * rank, lo:hi])

    def stacked_for(self, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        found = self.stacked.get(slots)
        if found is None:
            if len(self.stacked) >= _STACKS_KEPT:
                self.stacked.pop(next(iter(self.stacked)))
            width = max(self.widths[s] for s in slots)
            index = torch.tensor(slots, device=self.ua.device)
            found = self.stacked[slots] = (self.ua[:, :, :width].index_select(0, index),
                                           self.ub[:, :width].index_select(0, index))
        return found

    def by_slot(self, placed: torch.Tensor, reach: int) -> torch.Tensor:
        """The LoRA term of rows placed [reach, 1, in] at their slots' places."""
        width = max(self.widths[:reach])
        return torch.bmm(torch.bmm(placed, self.ua[:reach, :, :width]), self.ub[:reach, :width])


# Sets of slots whose stacked weights a projection keeps (a decode batch keeps one set
# for many steps; a few cover the sets that alternate as requests come and go).
_STACKS_KEPT = 4
# A batched group runs when at least this many segments form it.
_BATCH_FROM_SEGMENTS = 3
# A segment of at least this many rows expands slice by slice: below it, one matmul over
# the block-diagonal B costs less than a matmul per slice (measured on the demo model's
# projections: even at 128 rows, ahead by a sixth to two fifths from 300).
_BY_SLICE_FROM_ROWS = 192


@dataclass(slots=True)
class CpuPlan:
    """How one step's segments run on the CPU path, worked out once for all layers.

    - One-row segments (decodes of adapters with one running request, the many-adapter
      case) run by slot: each row goes to its slot's place in a [slots, in] block and two
      batched matmuls run over the slots' weights where they lie, unused slots up to the
      highest one included (no copy of the weights); when that reach is more than twice
      the rows, they join the next group instead.
    - The shortest of the other segments (a few adapters' decode rows) are padded to the
      longest of them and run as two batched matmuls over their slots' weights stacked
      (kept while the set of slots lasts), as long as the padding at most doubles the rows
      and none is long enough to expand slice by slice.
    - The rest (prompt chunks) run one by one, each two matmuls, or a shrink and an expand
      per slice when long.
    """

    segments: list[tuple[int, int, int]]  # run one by one: (start, length, slot)
    by_slot: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (rows, their slots, reach)
    slots: tuple[int, ...] = ()  # padded: the segments' slots, in row order
    length: int = 0  # padded: rows per padded segment
    gather: torch.Tensor | None = None  # [segments * length] rows of x (pads repeat a row)
    rows: torch.Tensor | None = None  # the real rows among them, where results are added
    real: torch.Tensor | None = None  # positions of the real rows in the padded layout

    @classmethod
    def of(cls, seg: Segments) -> CpuPlan:
        segments = seg.as_list()
        device = seg.starts.device
        plan = cls([])
        singles, seen = [], set()
        for start, n, slot in segments:
            if n == 1 and slot not in seen:
                singles.append((start, slot))
                seen.add(slot)
        reach = max(seen, default=-1) + 1
        if len(singles) >= _BATCH_FROM_SEGMENTS and reach <= 2 * len(singles):
            plan.by_slot = (torch.tensor([r for r, _ in singles], device=device),
                            torch.tensor([s for _, s in singles], device=device), reach)
            placed = {r for r, _ in singles}
            segments = [s for s in segments if s[1] != 1 or s[0] not in placed]
        by_length = sorted(segments, key=lambda s: s[1])
        count = total = 0
        for i, (_, n, _) in enumerate(by_length):
            if n * (i + 1) > 2 * (total + n) or n >= _BY_SLICE_FROM_ROWS:
                break
            count, total = i + 1, total + n
        if count < _BATCH_FROM_SEGMENTS:
            plan.segments = segments
            return plan
        batched = sorted(by_length[:count])
        plan.segments = sorted(by_length[count:])
        length = max(n for _, n, _ in batched)
        plan.slots = tuple(slot for _, _, slot in batched)
        plan.length = length
        gather, real = [], []
        for i, (start, n, _) in enumerate(batched):
            gather += list(range(start, start + n)) + [start] * (length - n)
            real += range(i * length, i * length + n)
        plan.gather = torch.tensor(gather, device=device)
        plan.rows = plan.gather[torch.tensor(real, device=device)]
        plan.real = None if len(real) == len(gather) else torch.tensor(real, device=device)
        return plan


def apply_cpu(x: torch.Tensor, y: torch.Tensor, plan: CpuPlan, stack: _Stack) -> None:
    """y += the LoRA term of the plan's rows (see CpuPlan)."""
    for start, length, slot in plan.segments:
        a, b = stack.compact(slot)
        rows = slice(start, start + length)
        if length >= _BY_SLICE_FROM_ROWS and stack.slices > 1:
            stack.expand_by_slice(x[rows] @ a, y[rows], slot)
        else:
            y[rows].addmm_(x[rows] @ a, b)  # [n, slices * rank] @ [.., out]
    if plan.by_slot is not None:
        rows, slots, reach = plan.by_slot
        placed = x.new_zeros(reach, 1, x.shape[1])
        placed[:, 0].index_copy_(0, slots, x.index_select(0, rows))
        y.index_add_(0, rows, stack.by_slot(placed, reach).squeeze(1).index_select(0, slots))
    if plan.gather is not None:
        a, b = stack.stacked_for(plan.slots)
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
        self.stacks = [{proj: _Stack(num_slots, modules, shapes, max_rank, dtype, device,
                                      not use_triton)
                        for proj, modules in PROJECTIONS.items()}
                       for _ in range(model.num_layers)]
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.slot_hash: list[str | None] = [None] * num_slots

    def load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copies an adapter's weights into ``slot`` (zeros where it adapts nothing).

        ``slot_hash[slot]`` names the adapter only once the copy is complete: after a copy
        that failed part-way it is None, never the previous adapter's hash.
        """
        self.clear_slot(slot)
        self.write_slot(slot, adapter)
        self.slot_hash[slot] = adapter.adapter_hash

    def clear_slot(self, slot: int) -> None:
        """The slot holds no adapter any more: its record and the stacked copies of it go.
        On the thread that runs the steps (they read and fill those stacks)."""
        self.slot_hash[slot] = None
        for layer in self.stacks:
            for stack in layer.values():
                for kept in [k for k in stack.stacked if slot in k]:
                    del stack.stacked[kept]

    def write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Writes an adapter's weights into a cleared slot. Safe beside a step whose rows do
        not use the slot: the batched paths multiply its weights, if at all, by zero rows."""
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
            for layer in self.stacks:
                for stack in layer.values():
                    stack.ua[slot].zero_()
                    stack.ub[slot].zero_()
                    stack.widths[slot] = stack.slices * adapter.rank
            for (layer, module), weights in adapter.modules.items():
                proj, index = TARGETS[module]
                stack = self.stacks[layer][proj]
                rank, first = weights.a.shape[0], index * adapter.rank
                stack.ua[slot, :, first:first + rank] = weights.a.T
                lo, hi = stack.offsets[index], stack.offsets[index + 1]
                scaled = (weights.b * weights.scaling).T  # [rank, out of the slice]
                stack.ub[slot, first:first + rank, lo:hi] = scaled

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor,
              seg: Segments, plan: CpuPlan | None = None) -> None:
        """y [tokens, out] += the LoRA term of x [tokens, in] for every adapter row."""
        stack = self.stacks[layer][proj]
        if not self.use_triton:
            apply_cpu(x, y, plan or CpuPlan.of(seg), stack)
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
