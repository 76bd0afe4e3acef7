"""SGMV shrink/expand in Triton (interpreter mode on CPU) against the torch references."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.sgmv import (
    Segments,
    sgmv_expand,
    sgmv_expand_reference,
    sgmv_shrink,
    sgmv_shrink_reference,
)
from tests.engine.kernel_testing import sparse_zeros

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it)")

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@st.composite
def layouts(draw):
    """Rows with adapter slots (or -1, base model) in runs; any mix of run lengths."""
    num_slots = draw(st.integers(1, 6))
    runs = draw(st.lists(st.tuples(st.integers(-1, num_slots - 1), st.integers(1, 20)),
                         min_size=1, max_size=8))
    row_slots = [slot for slot, n in runs for _ in range(n)]
    ranks = draw(st.lists(st.sampled_from([8, 16, 64]), min_size=num_slots,
                          max_size=num_slots))
    return num_slots, row_slots, ranks


def _weights(num_slots, slices, max_rank, in_dim, outs, ranks, dtype, gen):
    lora_a = torch.randn(num_slots, slices * max_rank, in_dim, generator=gen) * 0.1
    lora_b = torch.randn(num_slots, sum(outs), max_rank, generator=gen) * 0.1
    for slot, rank in enumerate(ranks):  # padding past the rank is zero, as the manager keeps it
        lora_a.view(num_slots, slices, max_rank, in_dim)[slot, :, rank:] = 0
        lora_b[slot, :, rank:] = 0
    return lora_a.to(dtype).to(DEVICE), lora_b.to(dtype).to(DEVICE)


@settings(max_examples=20, deadline=None)
@given(layout=layouts(), slices=st.sampled_from([(48,), (32, 16, 16), (40, 40)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 1000))
def test_shrink_and_expand_match_the_reference(layout, slices, dtype, seed):
    num_slots, row_slots, ranks = layout
    gen = torch.Generator().manual_seed(seed)
    max_rank, in_dim, outs = 64, 48, list(slices)
    offsets = [0]
    for width in outs:
        offsets.append(offsets[-1] + width)
    lora_a, lora_b = _weights(num_slots, len(outs), max_rank, in_dim, outs, ranks, dtype, gen)
    x = (torch.randn(len(row_slots), in_dim, generator=gen)).to(dtype).to(DEVICE)
    seg = Segments.from_row_slots(row_slots, DEVICE)
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    scales = torch.rand(num_slots, len(outs), generator=gen).to(DEVICE) + 0.5

    expected_buf = torch.zeros(len(row_slots), len(outs) * max_rank, device=DEVICE)
    sgmv_shrink_reference(x, lora_a, expected_buf, seg, ranks_t, max_rank)
    buf = torch.zeros_like(expected_buf)
    sgmv_shrink(x, lora_a, buf, seg, ranks_t, max_rank)
    torch.testing.assert_close(buf, expected_buf, **TOLERANCE[dtype])

    y0 = torch.randn(len(row_slots), offsets[-1], generator=gen).to(dtype).to(DEVICE)
    expected_y, y = y0.clone(), y0.clone()
    sgmv_expand_reference(expected_buf, lora_b, expected_y, seg, ranks_t, max_rank, offsets,
                          scales)
    sgmv_expand(expected_buf, lora_b, y, seg, ranks_t, max_rank, offsets, scales)
    torch.testing.assert_close(y.float(), expected_y.float(), **TOLERANCE[dtype])
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(y[base_rows], y0[base_rows])  # base-model rows are never touched


def test_reference_equals_a_plain_per_row_lora():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 8, 12, generator=gen)  # two slots, rank 8, one slice
    b = torch.randn(2, 10, 8, generator=gen)
    x = torch.randn(5, 12, generator=gen)
    row_slots = [1, 1, -1, 0, 1]
    seg = Segments.from_row_slots(row_slots)
    assert (seg.starts.tolist(), seg.lengths.tolist(), seg.slots.tolist()) == \
        ([0, 3, 4], [2, 1, 1], [1, 0, 1])
    buf = torch.zeros(5, 8)
    ranks = torch.tensor([8, 8], dtype=torch.int32)
    sgmv_shrink_reference(x, a, buf, seg, ranks, 8)
    y = torch.zeros(5, 10)
    scales = torch.tensor([[0.5], [2.0]])
    sgmv_expand_reference(buf, b, y, seg, ranks, 8, [0, 10], scales)
    for row, slot in enumerate(row_slots):
        expected = torch.zeros(10) if slot < 0 else \
            scales[slot, 0] * (b[slot] @ (a[slot] @ x[row]))
        torch.testing.assert_close(y[row], expected, atol=1e-4, rtol=1e-4)


def test_one_token_per_adapter_over_many_adapters():
    gen = torch.Generator().manual_seed(3)
    slots = 40
    a = torch.randn(slots, 16, 32, generator=gen).to(DEVICE)
    x = torch.randn(slots, 32, generator=gen).to(DEVICE)
    seg = Segments.from_row_slots(list(range(slots))[::-1], DEVICE)
    ranks = torch.full((slots,), 16, dtype=torch.int32, device=DEVICE)
    expected, actual = torch.zeros(slots, 16, device=DEVICE), torch.zeros(slots, 16, device=DEVICE)
    sgmv_shrink_reference(x, a, expected, seg, ranks, 16)
    sgmv_shrink(x, a, actual, seg, ranks, 16)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_wrappers_check_shapes_and_dtypes():
    x = torch.randn(4, 8)
    a = torch.randn(2, 16, 8)
    seg = Segments.from_row_slots([0, 0, 1, 1])
    ranks = torch.tensor([16, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="fp32"):
        sgmv_shrink(x, a, torch.zeros(4, 16, dtype=torch.float16), seg, ranks, 16)
    with pytest.raises(ValueError, match="shapes"):
        sgmv_shrink(x, a, torch.zeros(4, 8), seg, ranks, 16)
    with pytest.raises(ValueError, match="past the last row"):
        sgmv_shrink(x[:3], a, torch.zeros(3, 16), seg, ranks, 16)
    b = torch.randn(2, 6, 16)
    with pytest.raises(ValueError, match="slice_offsets"):
        sgmv_expand(torch.zeros(4, 16), b, torch.zeros(4, 6), seg, ranks, 16, [0, 7],
                    torch.ones(2, 1))


def test_empty_segments_and_a_batch_of_only_base_rows_change_nothing():
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(3, 16, 24, generator=gen).to(DEVICE)
    b = torch.randn(3, 20, 16, generator=gen).to(DEVICE)
    x = torch.randn(6, 24, generator=gen).to(DEVICE)
    ranks = torch.full((3,), 16, dtype=torch.int32, device=DEVICE)
    scales = torch.ones(3, 1, device=DEVICE)

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    seg = Segments(as_tensor([0, 2, 2]), as_tensor([2, 0, 3]), as_tensor([1, 0, 2]), 3)
    expected_buf, buf = torch.zeros(6, 16, device=DEVICE), torch.zeros(6, 16, device=DEVICE)
    sgmv_shrink_reference(x, a, expected_buf, seg, ranks, 16)
    sgmv_shrink(x, a, buf, seg, ranks, 16)
    torch.testing.assert_close(buf, expected_buf, atol=1e-4, rtol=1e-4)
    y0 = torch.randn(6, 20, generator=gen).to(DEVICE)
    expected_y, y = y0.clone(), y0.clone()
    sgmv_expand_reference(expected_buf, b, expected_y, seg, ranks, 16, [0, 20], scales)
    sgmv_expand(expected_buf, b, y, seg, ranks, 16, [0, 20], scales)
    torch.testing.assert_close(y, expected_y, atol=1e-4, rtol=1e-4)
    assert torch.equal(y[5], y0[5])  # row 5 is in no segment
    none = Segments.from_row_slots([-1] * 6, DEVICE)
    untouched = y0.clone()
    sgmv_expand(buf, b, untouched, none, ranks, 16, [0, 20], scales)
    assert len(none) == 0 and torch.equal(untouched, y0)


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the rows would take 48 GiB of memory")
def test_rows_past_2_to_the_32_elements_are_addressed_in_64_bits(tmp_path):
    width, rows = 64, 4  # in = out = max rank = width, one slice
    far = 2**32 // width + 1  # row * stride in int32 wraps to row 1
    x, buf, y = (sparse_zeros(tmp_path / name, (far + rows, width), torch.float32)
                 for name in ("x", "buf", "y"))
    gen = torch.Generator().manual_seed(0)
    x[far:] = torch.randn(rows, width, generator=gen)
    y[far:] = y0 = torch.randn(rows, width, generator=gen)
    lora_a, lora_b = (torch.randn(1, width, width, generator=gen) * 0.1 for _ in range(2))
    seg = Segments(torch.tensor([far], dtype=torch.int32), torch.tensor([rows], dtype=torch.int32),
                   torch.tensor([0], dtype=torch.int32), max_length=rows)
    ranks, scales = torch.tensor([width], dtype=torch.int32), torch.tensor([[0.5]])
    sgmv_shrink(x, lora_a, buf, seg, ranks, width)
    sgmv_expand(buf, lora_b, y, seg, ranks, width, [0, width], scales)
    expected_buf = x[far:] @ lora_a[0].T
    torch.testing.assert_close(buf[far:], expected_buf, **TOLERANCE[torch.float32])
    torch.testing.assert_close(y[far:], y0 + 0.5 * expected_buf @ lora_b[0].T,
                               **TOLERANCE[torch.float32])
