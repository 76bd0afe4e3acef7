"""The Triton paged-decode kernel against its torch reference (interpreter mode on CPU)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.paged_attention import (
    DecodePlan,
    paged_decode_attention,
    paged_decode_reference,
)
from tests.engine.kernel_testing import sparse_zeros

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it)")


def _case(batch: int, kv_heads: int, group: int, head_dim: int, block_size: int,
          lengths: list[int], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lengths)
    num_blocks = batch * max_blocks + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen).to(dtype)
    # Every sequence gets distinct blocks in a shuffled order; unused table slots hold 0.
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    for b, n in enumerate(lengths):
        used = -(-n // block_size)
        tables[b, :used] = torch.tensor(order[b * max_blocks:b * max_blocks + used])
    lens = torch.tensor(lengths, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, lens)]


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 4),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([16, 32, 64, 80]),
    block_size=st.sampled_from([16, 32]),
    lengths=st.lists(st.integers(1, 70), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_fp32(batch, kv_heads, group, head_dim, block_size, lengths,
                                       seed):
    args = _case(batch, kv_heads, group, head_dim, block_size, lengths[:batch], torch.float32,
                 seed)
    expected = paged_decode_reference(*args, scale=head_dim ** -0.5)
    actual = paged_decode_attention(*args, scale=head_dim ** -0.5)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lengths", [[1, 16, 17, 64], [33, 2, 100, 5]])
def test_kernel_matches_reference_bf16(lengths):
    args = _case(4, 2, 4, 64, 16, lengths, torch.bfloat16, seed=1)
    expected = paged_decode_reference(*[a.float() if a.is_floating_point() else a for a in args],
                                      scale=0.125)
    actual = paged_decode_attention(*args, scale=0.125)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


def test_wrapper_rejects_mismatched_shapes_and_dtypes():
    q, k, v, tables, lens = _case(2, 2, 2, 16, 16, [5, 9], torch.float32, seed=0)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k, v, tables.long(), lens, scale=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention(q[:, :3], k, v, tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, k, v, tables[:1], lens, scale=1.0)
    small = k[:, :8].contiguous()
    with pytest.raises(ValueError, match="block size"):
        paged_decode_attention(q, small, small, tables, lens, scale=1.0)


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the cache would take 8 GiB of memory")
def test_blocks_past_2_to_the_32_elements_are_addressed_in_64_bits(tmp_path):
    block_size, head_dim = 16, 16
    far = 2**32 // (block_size * head_dim) + 1  # block * stride in int32 wraps to block 1
    cache = sparse_zeros(tmp_path / "kv", (far + 1, block_size, 1, head_dim), torch.float16)
    gen = torch.Generator().manual_seed(0)
    cache[far] = torch.randn(block_size, 1, head_dim, generator=gen).half()
    q = torch.randn(1, 2, head_dim, generator=gen).half()
    tables = torch.tensor([[far]], dtype=torch.int32)
    lens = torch.tensor([block_size], dtype=torch.int32)
    expected = paged_decode_reference(q, cache, cache, tables, lens, scale=0.25)
    actual = paged_decode_attention(q, cache, cache, tables, lens, scale=0.25)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_the_torch_path_over_groups_of_a_shared_plan_attends_each_rows_own_context():
    """20 rows of shuffled lengths: two groups, rows picked out and put back; one plan,
    made once a step, serves every layer (each its own cache) and gives each row exactly
    its own keys."""
    lengths = [5, 70, 17, 1, 33, 64, 2, 48, 16, 9, 31, 50, 3, 66, 12, 40, 7, 28, 55, 21]
    q, k_cache, v_cache, tables, lens = _case(20, 2, 2, 16, 16, lengths, torch.float32, 3)
    plan = DecodePlan(tables, lens, block_size=16)
    assert len(plan.groups) == 2 and not plan.whole
    for layer in range(2):  # a second layer: other caches, the same plan
        if layer:
            k_cache, v_cache = torch.randn_like(k_cache), torch.randn_like(v_cache)
        out = paged_decode_reference(q, k_cache, v_cache, tables, lens, scale=0.25, plan=plan)
        for row, n in enumerate(lengths):
            blocks = tables[row, :-(-n // 16)].long()
            k = k_cache[blocks].reshape(-1, 2, 16)[:n].repeat_interleave(2, dim=1)  # [n, 4, 16]
            v = v_cache[blocks].reshape(-1, 2, 16)[:n].repeat_interleave(2, dim=1)
            weights = torch.softmax(torch.einsum("hd,nhd->hn", q[row], k) * 0.25, dim=-1)
            torch.testing.assert_close(out[row], torch.einsum("hn,nhd->hd", weights, v),
                                       atol=1e-5, rtol=1e-5)
    one = DecodePlan(tables[:1], lens[:1], block_size=16)
    assert one.whole  # one row: attended in place, nothing picked out
