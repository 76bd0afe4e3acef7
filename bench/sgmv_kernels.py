"""LoRA shrink + expand implementations across segment layouts (one fused QKV projection).

Compared in the same run, each adding the LoRA term of every adapter row to ``y``:
- ``engine_cpu``: the engine's CPU path (two matmuls per segment, compact block-diagonal B);
- ``sgmv_reference``: the torch SGMV reference (the kernels' oracle: per segment, per slice);
- ``per_adapter_loop``: for each distinct adapter, gather its rows, matmul, scatter back;
- ``gather_bmm``: gather every row's A and B, then batched matmuls;
- ``triton_sgmv``: the Triton kernels (CUDA only; the interpreter is not a timing).

Shapes are the demo model's QKV (in 256, out 256+128+128) unless given; rank 16.

    .venv/bin/python bench/sgmv_kernels.py [--hidden 256] [--rank 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import write_result  # noqa: E402
from engine.kernels.sgmv import Segments, sgmv_expand_reference, sgmv_shrink_reference  # noqa: E402
from engine.lora.manager import CpuPlan, _Stack, apply_cpu  # noqa: E402

LAYOUTS = {  # name -> row slots (-1: base model)
    "decode 64 rows, 1 adapter": [0] * 64,
    "decode 64 rows, 8 adapters": [i // 8 for i in range(64)],
    "decode 64 rows, 64 adapters": list(range(64)),
    "decode 64 rows, half base": [-1] * 32 + [i // 4 for i in range(32)],
    "prefill 512 rows, 4 adapters": [i // 128 for i in range(512)],
}


def timed(fn, repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6  # microseconds


@dataclass
class Weights:
    """Every slot's LoRA weights in the kernels' layout and in the engine CPU path's."""

    a: torch.Tensor  # [slots, slices*r, hidden]
    b: torch.Tensor  # [slots, out, r]
    dense: list[tuple[torch.Tensor, torch.Tensor]]  # per slot: A, block-diagonal B
    stacked_dense: torch.Tensor  # [slots, slices*r, out]
    offsets: list[int]
    rank: int
    hidden: int
    dtype: torch.dtype
    device: str

    @property
    def slices(self) -> int:
        return len(self.offsets) - 1


def build_weights(*, hidden: int, outs: list[int], rank: int, device: str,
                  dtype: torch.dtype, gen: torch.Generator, slots: int = 64) -> Weights:
    slices, r = len(outs), rank
    offsets = [0]
    for width in outs:
        offsets.append(offsets[-1] + width)
    a = (torch.randn(slots, slices * r, hidden, generator=gen) * 0.05).to(dtype).to(device)
    b = (torch.randn(slots, offsets[-1], r, generator=gen) * 0.05).to(dtype).to(device)
    # The engine CPU path's compact block-diagonal copies.
    dense = []
    for slot in range(slots):
        bd = torch.zeros(slices * r, offsets[-1], dtype=dtype, device=device)
        for s in range(slices):
            bd[s * r:(s + 1) * r, offsets[s]:offsets[s + 1]] = b[slot, offsets[s]:offsets[s + 1]].T
        dense.append((a[slot].contiguous(), bd))
    return Weights(a=a, b=b, dense=dense, stacked_dense=torch.stack([d for _, d in dense]),
                   offsets=offsets, rank=r, hidden=hidden, dtype=dtype, device=device)


def torch_implementations(w: Weights, x: torch.Tensor, y: torch.Tensor, seg: Segments,
                          row_slots: list[int]) -> dict:
    """The CPU-capable implementations, each adding the LoRA term to ``y``."""
    slot_t = torch.tensor(row_slots, device=w.device)
    adapter_rows = (slot_t >= 0).nonzero().flatten()
    scales = torch.ones(w.a.shape[0], w.slices, device=w.device)
    ranks = torch.full((w.a.shape[0],), w.rank, dtype=torch.int32, device=w.device)

    def engine_cpu():
        for start, length, slot in seg.as_list():
            da, db = w.dense[slot]
            y[start:start + length].addmm_(x[start:start + length] @ da.T, db)

    # The engine's CPU path (engine/lora/manager.py): its plan of the step, over the
    # slots' compact copies as the engine keeps them (one stack per projection).
    plan = CpuPlan.of(seg)
    names = tuple(f"slice{s}" for s in range(w.slices))
    stack = _Stack(w.a.shape[0], names, {n: (w.hidden, w.offsets[s + 1] - w.offsets[s])
                                         for s, n in enumerate(names)},
                   w.rank, w.dtype, torch.device(w.device), compact=True)
    for slot, (da, db) in enumerate(w.dense):
        stack.ua[slot], stack.ub[slot] = da.T, db
        stack.widths[slot] = w.slices * w.rank

    def engine_cpu_batched():
        apply_cpu(x, y, plan, stack)

    def reference():
        buf = torch.empty(len(row_slots), w.slices * w.rank, device=w.device)
        sgmv_shrink_reference(x, w.a, buf, seg, ranks, w.rank)
        sgmv_expand_reference(buf, w.b, y, seg, ranks, w.rank, w.offsets, scales)

    def per_adapter():
        for slot in torch.unique(slot_t[adapter_rows]).tolist():
            idx = (slot_t == slot).nonzero().flatten()
            da, db = w.dense[slot]
            y.index_add_(0, idx, (x[idx] @ da.T) @ db)

    def gather_bmm():
        sl = slot_t[adapter_rows]
        t = torch.bmm(w.a[sl], x[adapter_rows].unsqueeze(-1))  # [n, slices*r, 1]
        stacked = w.stacked_dense[sl]  # [n, slices*r, out]
        y.index_add_(0, adapter_rows, torch.bmm(t.transpose(1, 2), stacked).squeeze(1))

    return {"engine_cpu": engine_cpu, "engine_cpu_batched": engine_cpu_batched,
            "sgmv_reference": reference, "per_adapter_loop": per_adapter,
            "gather_bmm": gather_bmm}


def triton_implementation(w: Weights, x: torch.Tensor, y: torch.Tensor, seg: Segments,
                          row_slots: list[int]):
    from engine.kernels.sgmv import sgmv_expand, sgmv_shrink

    scales = torch.ones(w.a.shape[0], w.slices, device=w.device)
    ranks = torch.full((w.a.shape[0],), w.rank, dtype=torch.int32, device=w.device)

    def triton_sgmv():
        buf = torch.empty(len(row_slots), w.slices * w.rank, device=w.device)
        sgmv_shrink(x, w.a, buf, seg, ranks, w.rank)
        sgmv_expand(buf, w.b, y, seg, ranks, w.rank, w.offsets, scales)
        torch.cuda.synchronize()

    return triton_sgmv


def measure(w: Weights, name: str, row_slots: list[int], repeat: int,
            gen: torch.Generator) -> dict:
    x = torch.randn(len(row_slots), w.hidden, generator=gen).to(w.dtype).to(w.device)
    y = torch.zeros(len(row_slots), w.offsets[-1], dtype=w.dtype, device=w.device)
    seg = Segments.from_row_slots(row_slots, w.device)
    impls = torch_implementations(w, x, y, seg, row_slots)
    if w.device == "cuda":
        impls["triton_sgmv"] = triton_implementation(w, x, y, seg, row_slots)
    row = {"layout": name, "rows": len(row_slots), "segments": len(seg)}
    row.update({k: round(timed(fn, repeat), 1) for k, fn in impls.items()})
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--outs", type=int, nargs="+", default=[256, 128, 128])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    w = build_weights(hidden=args.hidden, outs=args.outs, rank=args.rank, device=device,
                      dtype=dtype, gen=gen)
    rows_out = [measure(w, name, row_slots, args.repeat, gen)
                for name, row_slots in LAYOUTS.items()]
    path = write_result("sgmv_kernels", {"device": device, "dtype": str(dtype),
                                         "hidden": args.hidden, "outs": args.outs,
                                         "rank": args.rank,
                                         "unit": "microseconds per call (median)",
                                         "rows": rows_out})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
