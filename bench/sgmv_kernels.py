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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import write_result  # noqa: E402
from engine.kernels.sgmv import Segments, sgmv_expand_reference, sgmv_shrink_reference  # noqa: E402
from engine.lora.manager import CpuPlan, apply_batched  # noqa: E402

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
    slots, r, slices = 64, args.rank, len(args.outs)
    offsets = [0]
    for width in args.outs:
        offsets.append(offsets[-1] + width)
    a = (torch.randn(slots, slices * r, args.hidden, generator=gen) * 0.05).to(dtype).to(device)
    b = (torch.randn(slots, offsets[-1], r, generator=gen) * 0.05).to(dtype).to(device)
    scales = torch.ones(slots, slices, device=device)
    ranks = torch.full((slots,), r, dtype=torch.int32, device=device)
    # The engine CPU path's compact block-diagonal copies.
    dense = []
    for slot in range(slots):
        bd = torch.zeros(slices * r, offsets[-1], dtype=dtype, device=device)
        for s in range(slices):
            bd[s * r:(s + 1) * r, offsets[s]:offsets[s + 1]] = b[slot, offsets[s]:offsets[s + 1]].T
        dense.append((a[slot].contiguous(), bd))
    stacked_dense = torch.stack([d for _, d in dense])  # [slots, slices*r, out]

    def measure(name: str, row_slots: list[int]) -> dict:
        x = torch.randn(len(row_slots), args.hidden, generator=gen).to(dtype).to(device)
        y = torch.zeros(len(row_slots), offsets[-1], dtype=dtype, device=device)
        seg = Segments.from_row_slots(row_slots, device)
        slot_t = torch.tensor(row_slots, device=device)
        adapter_rows = (slot_t >= 0).nonzero().flatten()

        def engine_cpu():
            for start, length, slot in seg.as_list():
                da, db = dense[slot]
                y[start:start + length].addmm_(x[start:start + length] @ da.T, db)

        # The engine's batched CPU path, with its slot stack built once (the engine keeps
        # it for as long as the step's set of slots lasts).
        plan = CpuPlan.of(seg)
        if plan.gather is not None:
            a_stack = torch.stack([dense[slot][0].T for slot in plan.slots])
            b_stack = torch.stack([dense[slot][1] for slot in plan.slots])

        def engine_cpu_batched():
            if plan.gather is None:
                return engine_cpu()  # the engine runs such a step per segment
            apply_batched(x, y, plan, a_stack, b_stack)

        def reference():
            buf = torch.empty(len(row_slots), slices * r, device=device)
            sgmv_shrink_reference(x, a, buf, seg, ranks, r)
            sgmv_expand_reference(buf, b, y, seg, ranks, r, offsets, scales)

        def per_adapter():
            for slot in torch.unique(slot_t[adapter_rows]).tolist():
                idx = (slot_t == slot).nonzero().flatten()
                da, db = dense[slot]
                y.index_add_(0, idx, (x[idx] @ da.T) @ db)

        def gather_bmm():
            sl = slot_t[adapter_rows]
            t = torch.bmm(a[sl], x[adapter_rows].unsqueeze(-1))  # [n, slices*r, 1]
            stacked = stacked_dense[sl]  # [n, slices*r, out]
            y.index_add_(0, adapter_rows, torch.bmm(t.transpose(1, 2), stacked).squeeze(1))

        impls = {"engine_cpu": engine_cpu, "engine_cpu_batched": engine_cpu_batched,
                 "sgmv_reference": reference,
                 "per_adapter_loop": per_adapter, "gather_bmm": gather_bmm}
        if device == "cuda":
            from engine.kernels.sgmv import sgmv_expand, sgmv_shrink

            def triton_sgmv():
                buf = torch.empty(len(row_slots), slices * r, device=device)
                sgmv_shrink(x, a, buf, seg, ranks, r)
                sgmv_expand(buf, b, y, seg, ranks, r, offsets, scales)
                torch.cuda.synchronize()

            impls["triton_sgmv"] = triton_sgmv
        row = {"layout": name, "rows": len(row_slots), "segments": len(seg)}
        row.update({k: round(timed(fn, args.repeat), 1) for k, fn in impls.items()})
        print(row, flush=True)
        return row

    rows_out = [measure(name, row_slots) for name, row_slots in LAYOUTS.items()]
    path = write_result("sgmv_kernels", {"device": device, "dtype": str(dtype),
                                         "hidden": args.hidden, "outs": args.outs,
                                         "rank": r, "unit": "microseconds per call (median)",
                                         "rows": rows_out})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
