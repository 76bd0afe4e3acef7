"""SGMV (segmented gather matrix-vector), Punica-style: many LoRA adapters in one batch.

The batch's token rows are grouped into segments, each a run of consecutive rows that
use the same adapter slot; rows outside every segment (base-model rows) are skipped.

- ``sgmv_shrink``: ``out[rows] = x[rows] @ lora_a[slot].T`` into an fp32 intermediate
  ``[tokens, slices * max_rank]``;
- ``sgmv_expand``: for each output slice s (q/k/v of a fused QKV projection, gate/up of
  a fused MLP projection, or a single one), ``y[rows, cols_s] += scale[slot, s] *
  out[rows, s*R:(s+1)*R] @ lora_b[slot, cols_s].T``.

Weights are stacked per slot and padded to the maximum rank R; ``ranks[slot]`` is the
adapter's own rank, and columns past it are neither read nor computed. Each kernel has a
torch reference with the same signature (``*_reference``), which the engine uses on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None


@dataclass(slots=True)
class Segments:
    """Runs of rows that share an adapter slot: rows [start, start + length) use ``slot``."""

    starts: torch.Tensor  # [segments] int32
    lengths: torch.Tensor  # [segments] int32
    slots: torch.Tensor  # [segments] int32
    max_length: int
    _list: list[tuple[int, int, int]] | None = field(default=None, repr=False)

    @classmethod
    def from_row_slots(cls, row_slots: list[int], device: torch.device | str = "cpu"
                       ) -> Segments:
        """Segments of consecutive equal slots, leaving out rows with slot -1 (base model)."""
        starts, lengths, slots = [], [], []
        for row, slot in enumerate(row_slots):
            if slot < 0:
                continue
            if slots and slots[-1] == slot and starts[-1] + lengths[-1] == row:
                lengths[-1] += 1
            else:
                starts.append(row)
                lengths.append(1)
                slots.append(slot)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(as_tensor(starts), as_tensor(lengths), as_tensor(slots), max(lengths, default=0))

    def __len__(self) -> int:
        return int(self.starts.numel())

    def as_list(self) -> list[tuple[int, int, int]]:
        """(start, length, slot) per segment, as Python ints (read once, then cached)."""
        if self._list is None:
            self._list = list(zip(self.starts.tolist(), self.lengths.tolist(),
                                  self.slots.tolist(), strict=True))
        return self._list


def _check_segments(seg: Segments, rows: int) -> None:
    for t in (seg.starts, seg.lengths, seg.slots):
        if t.dtype != torch.int32 or t.dim() != 1 or t.numel() != len(seg):
            raise ValueError("segment starts, lengths and slots must be int32 vectors of one size")
    if len(seg) and int((seg.starts + seg.lengths).max()) > rows:
        raise ValueError("a segment runs past the last row")


def _check_shrink(x: torch.Tensor, lora_a: torch.Tensor, out: torch.Tensor, seg: Segments,
                  ranks: torch.Tensor, max_rank: int) -> None:
    if x.dim() != 2 or lora_a.dim() != 3 or out.dim() != 2:
        raise ValueError("x must be [tokens, in], lora_a [slots, slices * R, in], "
                         "out [tokens, slices * R]")
    if lora_a.shape[2] != x.shape[1] or out.shape != (x.shape[0], lora_a.shape[1]):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, lora_a "
                         f"{tuple(lora_a.shape)}, out {tuple(out.shape)}")
    if lora_a.shape[1] % max_rank:
        raise ValueError("lora_a's rows must be a whole number of slices of max_rank")
    if out.dtype != torch.float32:
        raise ValueError("the shrink output is fp32")
    if ranks.dtype != torch.int32 or ranks.shape != (lora_a.shape[0],):
        raise ValueError("ranks must be int32 [slots]")
    _check_segments(seg, x.shape[0])


def _check_expand(buf: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, seg: Segments,
                  ranks: torch.Tensor, max_rank: int, slice_offsets: list[int],
                  scales: torch.Tensor) -> None:
    num_slices = len(slice_offsets) - 1
    if buf.dim() != 2 or lora_b.dim() != 3 or y.dim() != 2:
        raise ValueError("buf must be [tokens, slices * R], lora_b [slots, out, R], "
                         "y [tokens, out]")
    if buf.dtype != torch.float32:
        raise ValueError("the expand input is the fp32 shrink output")
    if lora_b.shape[2] != max_rank or buf.shape != (y.shape[0], num_slices * max_rank):
        raise ValueError(f"shapes do not fit: buf {tuple(buf.shape)}, lora_b "
                         f"{tuple(lora_b.shape)}, {num_slices} slices of rank {max_rank}")
    if slice_offsets[0] != 0 or not slice_offsets[-1] == y.shape[1] == lora_b.shape[1] \
            or any(b <= a for a, b in zip(slice_offsets, slice_offsets[1:], strict=False)):
        raise ValueError("slice_offsets must rise from 0 to the output width")
    if scales.dtype != torch.float32 or scales.shape != (lora_b.shape[0], num_slices):
        raise ValueError("scales must be fp32 [slots, slices]")
    if ranks.dtype != torch.int32 or ranks.shape != (lora_b.shape[0],):
        raise ValueError("ranks must be int32 [slots]")
    _check_segments(seg, y.shape[0])


# -- torch references ---------------------------------------------------------------------

def sgmv_shrink_reference(x: torch.Tensor, lora_a: torch.Tensor, out: torch.Tensor,
                          seg: Segments, ranks: torch.Tensor, max_rank: int) -> None:
    _check_shrink(x, lora_a, out, seg, ranks, max_rank)
    num_slices = lora_a.shape[1] // max_rank
    for start, length, slot in zip(seg.starts.tolist(), seg.lengths.tolist(),
                                   seg.slots.tolist(), strict=True):
        rank = int(ranks[slot])
        rows = x[start:start + length].float()
        out[start:start + length] = 0.0
        for s in range(num_slices):
            a = lora_a[slot, s * max_rank:s * max_rank + rank].float()  # [rank, in]
            out[start:start + length, s * max_rank:s * max_rank + rank] = rows @ a.T


def sgmv_expand_reference(buf: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor,
                          seg: Segments, ranks: torch.Tensor, max_rank: int,
                          slice_offsets: list[int], scales: torch.Tensor) -> None:
    _check_expand(buf, lora_b, y, seg, ranks, max_rank, slice_offsets, scales)
    for start, length, slot in zip(seg.starts.tolist(), seg.lengths.tolist(),
                                   seg.slots.tolist(), strict=True):
        rank = int(ranks[slot])
        for s, (lo, hi) in enumerate(zip(slice_offsets, slice_offsets[1:], strict=False)):
            part = buf[start:start + length, s * max_rank:s * max_rank + rank]  # [n, rank]
            b = lora_b[slot, lo:hi, :rank].float()  # [cols, rank]
            delta = (part @ b.T) * scales[slot, s]
            y[start:start + length, lo:hi] += delta.to(y.dtype)


# -- Triton kernels ------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, out_ptr, starts_ptr, lengths_ptr, slots_ptr, ranks_ptr,
                       K, N, R, stride_xm, stride_as, stride_an, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST: tl.constexpr):
        seg = tl.program_id(0)
        m_block = tl.program_id(1)
        n_block = tl.program_id(2)
        length = tl.load(lengths_ptr + seg)
        if m_block * BLOCK_M < length:
            start = tl.load(starts_ptr + seg)
            slot = tl.load(slots_ptr + seg)
            rank = tl.load(ranks_ptr + slot)
            m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
            m_ok = m < length
            # NOTE: row and slot offsets in int64: rows * stride can pass 2**31 elements.
            rows = (start + m).to(tl.int64)
            slot_off = slot.to(tl.int64) * stride_as
            n_live = (n < N) & (n % R < rank)  # columns past the adapter's rank stay 0
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                            mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
                a = tl.load(a_ptr + slot_off + n[None, :] * stride_an + k[:, None],
                            mask=k_ok[:, None] & n_live[None, :], other=0.0)  # [BK, BN]
                if UPCAST:
                    acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(x, a)
            tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], acc,
                     mask=m_ok[:, None] & (n < N)[None, :])

    @triton.jit
    def _expand_kernel(buf_ptr, b_ptr, y_ptr, starts_ptr, lengths_ptr, slots_ptr, ranks_ptr,
                       offsets_ptr, scales_ptr, R, BLOCKS_PER_SLICE, stride_bufm, stride_bs,
                       stride_bo, stride_ym, stride_ss,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       UPCAST: tl.constexpr):
        seg = tl.program_id(0)
        m_block = tl.program_id(1)
        piece = tl.program_id(2)
        length = tl.load(lengths_ptr + seg)
        if m_block * BLOCK_M < length:
            s = piece // BLOCKS_PER_SLICE
            lo = tl.load(offsets_ptr + s)
            hi = tl.load(offsets_ptr + s + 1)
            start = tl.load(starts_ptr + seg)
            slot = tl.load(slots_ptr + seg)
            rank = tl.load(ranks_ptr + slot)
            m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = lo + (piece % BLOCKS_PER_SLICE) * BLOCK_N + tl.arange(0, BLOCK_N)
            r = tl.arange(0, BLOCK_R)
            m_ok = m < length
            c_ok = cols < hi
            r_ok = r < rank
            rows = (start + m).to(tl.int64)  # int64 offsets, as in the shrink
            part = tl.load(buf_ptr + rows[:, None] * stride_bufm + s * R + r[None, :],
                           mask=m_ok[:, None] & r_ok[None, :], other=0.0)  # [BM, BR] fp32
            b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :] * stride_bo
                        + r[:, None],
                        mask=r_ok[:, None] & c_ok[None, :], other=0.0)  # [BR, BN]
            if UPCAST:
                delta = tl.dot(part, b.to(tl.float32), input_precision="ieee")
            else:
                delta = tl.dot(part.to(b.dtype), b)
            delta = delta * tl.load(scales_ptr + slot * stride_ss + s)
            y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
            ok = m_ok[:, None] & c_ok[None, :]
            y = tl.load(y_ptrs, mask=ok, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=ok)


def _upcast(dtype: torch.dtype) -> bool:
    # Exact fp32 products for fp32 weights; and Triton's interpreter has no bf16/fp16 dot.
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, out: torch.Tensor, seg: Segments,
                ranks: torch.Tensor, max_rank: int) -> None:
    """Triton shrink; same contract as ``sgmv_shrink_reference``."""
    _check_shrink(x, lora_a, out, seg, ranks, max_rank)
    if x.stride(1) != 1 or lora_a.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("the last dimension of x, lora_a and out must be contiguous")
    if not len(seg):
        return
    n = lora_a.shape[1]
    block_m, block_n, block_k = 16, min(64, max(16, triton.next_power_of_2(n))), 32
    grid = (len(seg), triton.cdiv(seg.max_length, block_m), triton.cdiv(n, block_n))
    _shrink_kernel[grid](x, lora_a, out, seg.starts, seg.lengths, seg.slots, ranks,
                         x.shape[1], n, max_rank, x.stride(0), lora_a.stride(0),
                         lora_a.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_K=block_k, UPCAST=_upcast(x.dtype))


def sgmv_expand(buf: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, seg: Segments,
                ranks: torch.Tensor, max_rank: int, slice_offsets: list[int],
                scales: torch.Tensor) -> None:
    """Triton expand, adding into ``y`` in place; same contract as the reference."""
    _check_expand(buf, lora_b, y, seg, ranks, max_rank, slice_offsets, scales)
    if buf.stride(1) != 1 or lora_b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("the last dimension of buf, lora_b and y must be contiguous")
    if not len(seg):
        return
    block_m, block_n = 16, 64
    widest = max(b - a for a, b in zip(slice_offsets, slice_offsets[1:], strict=False))
    per_slice = triton.cdiv(widest, block_n)
    offsets = torch.tensor(slice_offsets, dtype=torch.int32, device=y.device)
    grid = (len(seg), triton.cdiv(seg.max_length, block_m), per_slice * (len(slice_offsets) - 1))
    _expand_kernel[grid](buf, lora_b, y, seg.starts, seg.lengths, seg.slots, ranks, offsets,
                         scales, max_rank, per_slice, buf.stride(0), lora_b.stride(0),
                         lora_b.stride(1), y.stride(0), scales.stride(0), BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
                         UPCAST=_upcast(lora_b.dtype))
