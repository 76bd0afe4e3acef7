"""The engine's CPU LoRA path (per segment, or segments padded into batched matmuls)
against the SGMV reference, over random layouts of adapter rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.sgmv import Segments, sgmv_expand_reference, sgmv_shrink_reference
from engine.lora.adapter import TARGETS, LoRAAdapter, LoRAModule, module_shapes
from engine.lora.manager import _BY_SLICE_FROM_ROWS, PROJECTIONS, CpuPlan, LoRAManager
from engine.models.model_config import ModelConfig

NUM_SLOTS, MAX_RANK = 6, 16


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """A CPU manager with six adapters of ranks 4-16, each adapting its own modules."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    shapes = module_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    manager = LoRAManager(cfg, num_slots=NUM_SLOTS, max_rank=MAX_RANK, dtype=torch.float32,
                          device=torch.device("cpu"), use_triton=False)
    for slot, rank in enumerate([4, 8, 16, 8, 4, 16]):
        modules = {}
        for layer in range(cfg.num_layers):
            for i, module in enumerate(TARGETS):
                if (slot + i) % 3 == 0:
                    continue  # a module this adapter leaves alone
                fan_in, fan_out = shapes[module]
                modules[(layer, module)] = LoRAModule(
                    torch.randn(rank, fan_in, generator=gen) * 0.1,
                    torch.randn(fan_out, rank, generator=gen) * 0.1, scaling=0.5 + slot / 4)
        manager.load_slot(slot, LoRAAdapter(adapter_hash=f"h{slot}", rank=rank,
                                            modules=modules))
    return cfg, manager


def _reference(manager, layer, proj, x, y, seg):
    stack = manager.stacks[layer][proj]
    buf = torch.zeros(x.shape[0], stack.a.shape[1])
    sgmv_shrink_reference(x, stack.a, buf, seg, manager.ranks, manager.max_rank)
    sgmv_expand_reference(buf, stack.b, y, seg, manager.ranks, manager.max_rank, stack.offsets,
                          stack.scales)


@settings(max_examples=40, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(-1, NUM_SLOTS - 1), st.integers(1, 9)),
                     min_size=1, max_size=10),
       proj=st.sampled_from(list(PROJECTIONS)), seed=st.integers(0, 1000))
def test_both_cpu_paths_match_the_sgmv_reference(loaded, runs, proj, seed):
    cfg, manager = loaded
    row_slots = [slot for slot, n in runs for _ in range(n)]
    seg = Segments.from_row_slots(row_slots)
    stack = manager.stacks[1][proj]
    in_dim, out_dim = stack.a.shape[2], stack.offsets[-1]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(row_slots), in_dim, generator=gen)
    base = torch.randn(len(row_slots), out_dim, generator=gen)
    expected = base.clone()
    _reference(manager, 1, proj, x, expected, seg)
    per_segment = base.clone()
    manager.apply(1, proj, x, per_segment, seg, CpuPlan(seg.as_list()))  # never batched
    planned = base.clone()
    plan = CpuPlan.of(seg)
    manager.apply(1, proj, x, planned, seg, plan)
    torch.testing.assert_close(per_segment, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(planned, expected, atol=1e-5, rtol=1e-5)
    base_rows = [i for i, slot in enumerate(row_slots) if slot < 0]
    assert torch.equal(planned[base_rows], base[base_rows])  # base-model rows untouched


def test_prompt_chunks_expand_slice_by_slice_and_match_the_sgmv_reference(tiny_model_dir):
    """Segments long enough to expand over B's diagonal blocks one by one, from adapters
    whose modules differ in rank (a rank_pattern) and leave some modules alone."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    shapes = module_shapes(cfg)
    gen = torch.Generator().manual_seed(3)
    manager = LoRAManager(cfg, num_slots=3, max_rank=MAX_RANK, dtype=torch.float32,
                          device=torch.device("cpu"), use_triton=False)
    for slot, ranks in enumerate([(12, 4, 8), (16, 16, 16), (2, 0, 6)]):
        modules = {}
        for layer in range(cfg.num_layers):
            for i, module in enumerate(TARGETS):
                rank = ranks[i % 3]
                if rank:
                    fan_in, fan_out = shapes[module]
                    modules[(layer, module)] = LoRAModule(
                        torch.randn(rank, fan_in, generator=gen) * 0.1,
                        torch.randn(fan_out, rank, generator=gen) * 0.1, scaling=1.5 - slot / 2)
        manager.load_slot(slot, LoRAAdapter(adapter_hash=f"p{slot}", rank=max(ranks),
                                            modules=modules))
    long_ = _BY_SLICE_FROM_ROWS
    row_slots = [1] * long_ + [-1] * 5 + [0] * (long_ + 70) + [2] * (long_ + 1) + [1] * 3
    seg = Segments.from_row_slots(row_slots)
    plan = CpuPlan.of(seg)  # long ones never padded together
    assert [n for _, n, _ in plan.segments] == [long_, long_ + 70, long_ + 1, 3]
    for layer in range(cfg.num_layers):
        for proj in PROJECTIONS:
            stack = manager.stacks[layer][proj]
            x = torch.randn(len(row_slots), stack.a.shape[2], generator=gen)
            base = torch.randn(len(row_slots), stack.offsets[-1], generator=gen)
            expected, planned = base.clone(), base.clone()
            _reference(manager, layer, proj, x, expected, seg)
            manager.apply(layer, proj, x, planned, seg, plan)
            torch.testing.assert_close(planned, expected, atol=1e-5, rtol=1e-5)
            assert torch.equal(planned[long_:long_ + 5], base[long_:long_ + 5])


def test_how_a_plan_groups_segments():
    decode = Segments.from_row_slots([0, 0, 1, 1, 2, 2, 3])
    plan = CpuPlan.of(decode)
    assert plan.slots == (0, 1, 2, 3) and plan.length == 2
    assert plan.rows.tolist() == [0, 1, 2, 3, 4, 5, 6] and plan.real is not None
    one_row_each = CpuPlan.of(Segments.from_row_slots([4, 0, 1, 5]))
    rows, slots, reach = one_row_each.by_slot
    assert rows.tolist() == [0, 1, 2, 3] and slots.tolist() == [4, 0, 1, 5] and reach == 6
    assert not one_row_each.segments and one_row_each.gather is None
    far_apart = CpuPlan.of(Segments.from_row_slots([0, 1, 5, 9]))  # would read 10 slots
    assert far_apart.by_slot is None and far_apart.slots == (0, 1, 5, 9)
    prefill_among_decodes = Segments.from_row_slots([0] * 100 + [1, 2, 3])
    plan = CpuPlan.of(prefill_among_decodes)  # the one-row ones by slot, the chunk alone
    assert plan.by_slot[0].tolist() == [100, 101, 102] and plan.gather is None
    assert plan.segments == [(0, 100, 0)]
    assert CpuPlan.of(Segments.from_row_slots([0, 1])).gather is None  # two: per segment


def test_reloading_a_slot_drops_the_stacks_that_held_its_old_weights(loaded):
    cfg, manager = loaded
    padded = Segments.from_row_slots([0, 0, 1, 1, 2, 2, 4, 4])  # slot 2: rows 4 and 5
    single = Segments.from_row_slots([0, 1, 2, 4])  # by slot: the weights where they lie
    x = torch.randn(8, manager.stacks[0]["o"].a.shape[2])
    out_dim = manager.stacks[0]["o"].offsets[-1]

    def run(seg, rows):
        y = torch.zeros(rows, out_dim)
        manager.apply(0, "o", x[:rows], y, seg, CpuPlan.of(seg))
        return y

    before, before_single = run(padded, 8), run(single, 4)
    assert manager.stacks[0]["o"].stacked  # kept for the next step
    # NOTE: runs last in this module: it replaces slot 2 of the shared manager.
    fan_in, fan_out = module_shapes(cfg)["o_proj"]
    manager.load_slot(2, LoRAAdapter(adapter_hash="zero-o", rank=4, modules={
        (0, "o_proj"): LoRAModule(torch.zeros(4, fan_in), torch.zeros(fan_out, 4), 1.0)}))
    after, after_single = run(padded, 8), run(single, 4)
    assert torch.equal(after[4:6], torch.zeros_like(after[4:6]))  # the new, zero adapter
    assert torch.equal(after_single[2], torch.zeros_like(after_single[2]))
    assert not torch.equal(before[4:6], after[4:6])
    torch.testing.assert_close(after[[0, 1, 2, 3, 6, 7]], before[[0, 1, 2, 3, 6, 7]])
    torch.testing.assert_close(after_single[[0, 1, 3]], before_single[[0, 1, 3]])
