"""Paged-attention decode: one query token per sequence against its paged KV cache.

``paged_decode_attention`` is the Triton kernel (online softmax over the sequence's
blocks, one program per sequence and KV head, all query heads of the group at
once); ``paged_decode_reference`` is the torch path with the same signature, used
on CPU and as the kernel's oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("q must be [batch, heads, head_dim]; k/v caches "
                         "[blocks, block_size, kv_heads, head_dim] of one shape")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] \
            or context_lens.shape != (q.shape[0],):
        raise ValueError("block_tables must be [batch, max_blocks], context_lens [batch]")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("the K and V caches must share a dtype")


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The blocks each row of ``block_tables`` lists, in order: [rows, blocks * block_size, ...].

    NOTE: ``index_select`` on a 2-D view, not ``cache[tables]``: on CPU it copies about
    four times faster than advanced indexing.
    """
    rows, width = block_tables.shape
    flat = cache.view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1).long())
    return flat.view(rows, width * cache.shape[1], *cache.shape[2:])


class DecodePlan:
    """What the torch path needs of one step's decode rows, worked out once a step and
    used by every layer (it was worked out again in each: a host sync, a sort and a dozen
    small ops a layer): rows in groups of similar length (sorted, ``group_size`` at a
    time), each with the cache blocks it gathers (only as many as its longest member
    needs: padding every row to the longest context of the batch would copy and attend
    about twice the keys) and its mask."""

    __slots__ = ("groups", "whole")

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int, group_size: int = 16) -> None:
        lengths = context_lens.tolist()
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        # (rows, the blocks to gather flattened, how many per row, mask [b, 1, 1, L])
        self.groups: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]] = []
        for start in range(0, len(order), group_size):
            rows = order[start:start + group_size]
            width = -(-lengths[rows[-1]] // block_size)
            index = torch.tensor(rows, device=context_lens.device)
            blocks = block_tables[index, :width].reshape(-1).long()
            positions = torch.arange(width * block_size, device=context_lens.device)
            mask = (positions[None, :] < context_lens[index][:, None].long())[:, None, None, :]
            self.groups.append((index, blocks, width, mask))
        # One group of every row, in order: no row is picked out or put back.
        self.whole = len(self.groups) == 1 and order == list(range(len(order)))


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, group_size: int = 16,
                           plan: DecodePlan | None = None) -> torch.Tensor:
    """q [batch, heads, head_dim] -> [batch, heads, head_dim], in q's dtype.

    ``plan``: the step's ``DecodePlan`` of these block tables and lengths (made here when
    None)."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    if plan is None:
        plan = DecodePlan(block_tables, context_lens, k_cache.shape[1], group_size)
    if plan.whole:
        _, blocks, width, mask = plan.groups[0]
        return _attend(q, k_cache, v_cache, blocks, width, mask, scale)
    out = torch.empty_like(q)
    for index, blocks, width, mask in plan.groups:
        out[index] = _attend(q[index], k_cache, v_cache, blocks, width, mask, scale)
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            blocks: torch.Tensor, width: int, mask: torch.Tensor, scale: float) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    batch, head_dim = q.shape[0], q.shape[2]
    k = _gather(k_cache, blocks, batch, width).transpose(1, 2)  # [batch, kv_heads, L, dim]
    v = _gather(v_cache, blocks, batch, width).transpose(1, 2)
    # NOTE: the query heads of one KV head go in as that head's queries ([b, kv_heads,
    # group, head_dim]): no key or value is repeated per query head, and on CPU it runs
    # about a quarter faster than SDPA's own enable_gqa.
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, head_dim)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``gather_blocks`` of blocks already flattened: [rows, width * block_size, ...]."""
    flat = cache.view(cache.shape[0], -1).index_select(0, blocks)
    return flat.view(rows, width * cache.shape[1], *cache.shape[2:])


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                             stride_qb, stride_qh, stride_kn, stride_kt, stride_kh,
                             stride_tb, stride_ob, stride_oh,
                             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                             DIM_PAD: tl.constexpr, FP32: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        context = tl.load(lens_ptr + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        t = tl.arange(0, BLOCK_SIZE)
        heads = kv_head * GROUP + g
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GROUP_PAD, DIM_PAD]
        # NOTE: products in fp32 whatever the cache dtype (exact IEEE for fp32 caches, TF32
        # otherwise): decode is bound by reading the cache, not by the arithmetic, and
        # Triton's interpreter has no bf16 dot.
        q = q.to(tl.float32) * scale
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for i in range(0, tl.cdiv(context, BLOCK_SIZE)):
            # NOTE: int64: block * stride_kn passes 2**31 once the cache holds 2**31 elements
            # (4 GiB of fp16), and an int32 product would wrap to another block's address.
            block = tl.load(tables_ptr + seq * stride_tb + i).to(tl.int64)
            t_ok = i * BLOCK_SIZE + t < context
            offs = block * stride_kn + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BS, DIM_PAD]
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
            if FP32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))  # [GROUP_PAD, BLOCK_SIZE]
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            if FP32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p, v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / l_sum[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The Triton kernel; same contract as ``paged_decode_reference``."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check(q, k_cache, v_cache, block_tables, context_lens)
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride() \
            or block_tables.stride(1) != 1:
        raise ValueError("the head dimension (and block tables' rows) must be contiguous")
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError("the Triton kernel needs a power-of-two block size of at least 16")
    group = heads // kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        FP32=k_cache.dtype == torch.float32)
    return out
