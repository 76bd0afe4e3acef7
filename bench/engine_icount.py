"""The engine's work per decode token on two revisions, counted in instructions (callgrind).

Wall clock on a shared 2-core VM spreads more than the few percent an engine change is
held to (docs/benchmarks.md), and it has no hardware counters for `perf stat`. valgrind's
callgrind counts instructions instead, which repeat within about 0.4% between identical
runs once both trees' bytecode is compiled (it is, before the first count). Each revision
runs a fixed greedy workload (8 requests, 64-token prompts, the demo checkpoint, torch 1
thread, EOS ignored) at two output lengths; the difference between them is the decode loop
alone, without imports and start-up.

    .venv/bin/python bench/engine_icount.py --before df38d23 [--after dd98871]

`--after` defaults to this checkout; `--short` and `--long` set the two output lengths.
Each run of the long workload takes about 6 minutes under valgrind; two run at a time.
Writes bench/results/engine_icount.json.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.workload import write_result  # noqa: E402

DRIVER = """
import random, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from engine import protocol
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
model_dir, out_tokens = sys.argv[1], int(sys.argv[2])
engine = LLMEngine(EngineConfig(model_dir=Path(model_dir), max_num_seqs=64,
                                max_num_batched_tokens=512, num_kv_blocks=512))
rng = random.Random(0)
for i in range(8):
    prompt = [rng.randrange(10, 1400) for _ in range(64)]
    engine.add_request(protocol.EngineRequest(
        request_id=f"r{i}", model="bench", prompt_token_ids=prompt, tenant_id="t",
        cache_salt="t", sampling=protocol.SamplingSpec(max_tokens=out_tokens, temperature=0.0,
                                                       ignore_eos=True)))
while engine.has_unfinished():
    engine.step()
"""


def count(tree: Path, model_dir: Path, out_tokens: int) -> int:
    """Instructions callgrind collects for the workload run from ``tree``."""
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         "-c", DRIVER, str(model_dir), str(out_tokens)],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"},
        capture_output=True, text=True, check=True)
    return int(re.search(r"Collected : (\d+)", done.stderr).group(1))


def compile_tree(tree: Path) -> None:
    """Writes the tree's bytecode before any run is counted: in a new worktree the first run
    to import a module compiles it, and two runs at a time split that work between them
    differently each time (the 'before' tree's counts moved by up to 5.7% between
    sessions while the compiled checkout's repeated within 0.2%)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-x",
                    r"(^|/)(\.venv|var|node_modules|\.git)/", str(tree)], check=True)


def worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(where),
                    rev], check=True)
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default=None, help="a revision; default: this checkout")
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=112)
    parser.add_argument("--out", default="engine_icount", help="bench/results/<out>.json")
    args = parser.parse_args()
    from engine.demo_model import build_model

    tmp = Path(tempfile.mkdtemp(prefix="icount-"))
    model_dir = build_model(tmp / "model", size="demo", seed=0)
    trees = {"before": worktree(args.before, tmp / "before"),
             "after": worktree(args.after, tmp / "after") if args.after else ROOT}
    for tree in trees.values():  # a run that compiled bytecode would count the compile too
        compile_tree(tree)
    jobs = [(side, n) for n in (args.short, args.long) for side in trees]
    try:
        with ThreadPoolExecutor(2) as pool:
            counts = dict(zip(jobs, pool.map(lambda job: count(trees[job[0]], model_dir,
                                                                job[1]), jobs), strict=True))
    finally:
        for side in ("before", "after"):
            if trees[side] != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(trees[side])], check=False)
    decode_tokens = 8 * (args.long - args.short)
    per_token = {side: (counts[(side, args.long)] - counts[(side, args.short)]) / decode_tokens
                 for side in trees}
    ratio = per_token["after"] / per_token["before"]
    path = write_result(args.out, {
        "before": args.before, "after": args.after or "this checkout",
        "workload": {"requests": 8, "prompt_tokens": 64, "short": args.short,
                     "long": args.long},
        "instructions": {f"{side}@{n}": value for (side, n), value in counts.items()},
        "instructions_per_decode_token": {k: round(v) for k, v in per_token.items()},
        "after_over_before": round(ratio, 4)})
    print(f"instructions per decode token: before {per_token['before']:,.0f}, "
          f"after {per_token['after']:,.0f}, after / before {ratio:.4f} -> {path}")


if __name__ == "__main__":
    main()
