"""The engine before and after a change, side by side in one run.

Checks out a git revision into a temporary worktree and runs the same workload as
`engine_throughput.py` (mixed prompts, Poisson arrivals, greedy, EOS ignored) on the
engine of that revision and on the engine of this checkout, alternating A, B, B, A, A, B,
... in fresh processes so drift on the machine, and the place in a round, land on both
sides. Each side runs its
own tree's `bench/engine_throughput.py:run_engine` on the same demo checkpoint.

    .venv/bin/python bench/engine_ab.py --before df38d23 [--rounds 7] [--requests 32]

Writes bench/results/engine_ab.json: every round's figures, the medians, and the
after/before ratios of output tokens per second and of CPU time per output token (the
steadier figure on a shared machine; torch runs one thread per side by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.workload import write_result  # noqa: E402

# Run inside a fresh interpreter whose sys.path starts at the tree under test.
DRIVER = """
import json, sys, time, torch
from bench import engine_throughput as et
from bench.workload import poisson_workload
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
model_dir, requests, rate = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]))
torch.manual_seed(0)
engine = LLMEngine(EngineConfig(model_dir=model_dir, max_num_seqs=64,
                                max_num_batched_tokens=512))
vocab = range(10, engine.vocab_size)
et.run_engine(engine, poisson_workload(n=2, rate=0, prompt_len=(32, 32), output_len=(4, 4),
                                       vocab=vocab, seed=1))
cpu = time.process_time()
result = et.run_engine(engine, poisson_workload(
    n=requests, rate=rate, prompt_len=(16, 1024), output_len=(16, 256), vocab=vocab, seed=0))
cpu = time.process_time() - cpu
result["cpu_ms_per_output_token"] = round(1000 * cpu / result["output_tokens"], 4)
print(json.dumps(result))
"""


def run_side(tree: Path, model_dir: Path, requests: int, rate: float, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", DRIVER, str(model_dir), str(requests),
                           str(rate), str(threads)], cwd=tree, env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def worktree(revision: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(where),
                    revision], check=True, capture_output=True)
    return where


def median_of(rounds: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="mean arrivals per second; 0 (the default): all at once, so "
                             "the figure is capacity alone, not arrival timing")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per side; 1 (the default) makes CPU time per "
                             "token the steadiest figure on a shared machine")
    args = parser.parse_args()

    from engine.demo_model import build_model

    scratch = Path(tempfile.mkdtemp(prefix="engine-ab-"))
    model_dir = build_model(scratch / "model", size="demo")
    before_tree = worktree(args.before, scratch / "before")
    sides: dict[str, list[dict]] = {"before": [], "after": []}
    try:
        for i in range(args.rounds):
            order = (("before", before_tree), ("after", ROOT))
            # NOTE: ABBA: the side that runs second in a round measured about 8% slower
            # whichever it was, so the order flips every round.
            for name, tree in order if i % 2 == 0 else order[::-1]:
                sides[name].append(run_side(tree, model_dir, args.requests, args.rate,
                                            args.threads))
                last = sides[name][-1]
                print(f"round {i + 1} {name}: {last['output_tokens_per_s']:.1f} tok/s, "
                      f"{last['cpu_ms_per_output_token']:.3f} CPU ms/token", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(before_tree)], capture_output=True)
    medians = {name: {"output_tokens_per_s": median_of(rounds, "output_tokens_per_s"),
                      "cpu_ms_per_output_token": median_of(rounds, "cpu_ms_per_output_token"),
                      "ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] for r in rounds),
                      "tpot_p50_ms": statistics.median(r["tpot_ms"]["p50"] for r in rounds)}
               for name, rounds in sides.items()}
    ratio = medians["after"]["output_tokens_per_s"] / medians["before"]["output_tokens_per_s"]
    cpu_ratio = (medians["after"]["cpu_ms_per_output_token"]
                 / medians["before"]["cpu_ms_per_output_token"])
    path = write_result("engine_ab", {
        "before": args.before, "workload": {
            "requests": args.requests, "rate_per_s": args.rate, "prompt_len": [16, 1024],
            "output_len": [16, 256], "torch_threads": args.threads},
        "rounds": sides, "medians": medians, "throughput_after_over_before": round(ratio, 4),
        "cpu_per_token_after_over_before": round(cpu_ratio, 4)})
    print(json.dumps(medians, indent=2))
    print(f"after / before: output tokens per second {ratio:.3f}, CPU time per output "
          f"token {cpu_ratio:.3f} -> {path}")


if __name__ == "__main__":
    main()
