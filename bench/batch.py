"""The Batch API against interactive traffic, under the real `atrium up` (demo model, CPU).

Interactive traffic: streamed chat completions from the official openai package, open-loop
(Poisson arrivals at --rate per second for --seconds, the same seeded schedule each
round), each request's time to first token measured by the client. Rounds:

- *alone*: the interactive traffic and nothing else;
- *with batch*: the same traffic while a --lines-line batch runs (submitted through
  files.create and batches.create, and running before the traffic starts);

alternate (--rounds of each; each round its own seeded schedule, the same for both
kinds); each *with batch* round submits a fresh batch and cancels it when the round ends,
so no *alone* round has a batch running. The figures pool each kind's requests over its
rounds (a round's p95 is a handful of requests). Then another batch of --lines runs with
no interactive traffic, and its throughput is measured: lines and completion tokens a
second, from its creation to its completion.
Writes bench/results/batch.json.

    .venv/bin/python bench/batch.py --lines 2000 --rate 4 --seconds 40 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from bench.first_hour import BIN, _env, _port, _start, _stop  # noqa: E402
from bench.workload import machine, write_result  # noqa: E402

MODEL = "atrium-demo"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _interactive(base: str, key: str, rate: float, seconds: float, seed: int
                       ) -> dict[str, float | int | None]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    rng = random.Random(seed)
    ttfts: list[float] = []
    failures = 0

    async def one(i: int) -> None:
        nonlocal failures
        began = time.perf_counter()
        try:
            stream = await client.chat.completions.create(
                model=MODEL, stream=True, max_tokens=16, temperature=0,
                messages=[{"role": "user", "content": f"Interactive question {i}"}])
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    ttfts.append(time.perf_counter() - began)
                    break
            await stream.close()
        except Exception:  # noqa: BLE001 - counted
            failures += 1

    tasks, at, i = [], 0.0, 0
    start = time.perf_counter()
    while at < seconds:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one(i)))
        i += 1
        at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    await client.close()
    return {"requests": i, "failures": failures, "ttft_p50_s": _pct(ttfts, 0.5),
            "ttft_p95_s": _pct(ttfts, 0.95), "ttfts": ttfts}


def _batch_file(lines: int) -> bytes:
    rows = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": 8, "temperature": 0,
                      "messages": [{"role": "user", "content": f"Summarize record {i}"}]}}
            for i in range(lines)]
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def _submit(client, lines: int):
    source = client.files.create(file=("bench.jsonl", _batch_file(lines)), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")


def _wait_running(client, batch_id: str, min_done: int = 20) -> None:
    deadline = time.monotonic() + 300
    while client.batches.retrieve(batch_id).request_counts.completed < min_done:
        if time.monotonic() > deadline:
            raise SystemExit("the batch did not start")
        time.sleep(0.5)


def _wait_done(client, batch_id: str) -> None:
    while client.batches.retrieve(batch_id).status not in ("completed", "failed",
                                                           "cancelled", "expired"):
        time.sleep(0.5)


def _stop_batch(client, batch_id: str) -> int:
    """Cancels the batch and waits for it to end: the next *alone* round runs with none.
    Returns how many of its lines were answered."""
    if client.batches.retrieve(batch_id).status == "in_progress":
        client.batches.cancel(batch_id)
    _wait_done(client, batch_id)
    return client.batches.retrieve(batch_id).request_counts.completed


def _throughput(client, lines: int) -> dict[str, float]:
    """A fresh batch's pace with no interactive traffic, from its creation to its end."""
    batch_id = _submit(client, lines).id
    began, done0 = time.monotonic(), 0
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            break
        time.sleep(0.5)
    elapsed = time.monotonic() - began
    lines = batch.request_counts.completed - done0
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text
              .splitlines()]
    tokens = statistics.mean(o["response"]["body"]["usage"]["completion_tokens"]
                             for o in output)
    return {"lines_measured": lines, "seconds": round(elapsed, 1),
            "lines_per_s": round(lines / elapsed, 2),
            "completion_tokens_per_s": round(lines * tokens / elapsed, 1),
            "completed": batch.request_counts.completed,
            "failed": batch.request_counts.failed, "status": batch.status}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="ATRIUM_BATCH_CONCURRENCY for the run (default: the setting's)")
    args = parser.parse_args()
    from openai import OpenAI

    home = Path(tempfile.mkdtemp(prefix="atrium-bench-batch-"))
    port = _port()
    base = f"http://127.0.0.1:{port}"
    extra = {} if args.concurrency is None else {
        "ATRIUM_BATCH_CONCURRENCY": str(args.concurrency)}
    proc, lines, _ = _start(home, port, extra)
    try:
        key = re.search(r"\(shown once\): (atr_\w+)", "".join(lines)).group(1)
        subprocess.run([str(BIN / "atrium"), "set-limits", "demo", "--requests-per-minute",
                        "1000000", "--tokens-per-minute", "1000000000",
                        "--max-concurrent-requests", "10000"], env=_env(home), cwd=home,
                       check=True, capture_output=True)
        client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
        asyncio.run(_interactive(base, key, args.rate, 5, seed=0))  # warm up
        rounds: dict[str, list[dict]] = {"alone": [], "with_batch": []}
        for r in range(args.rounds):
            rounds["alone"].append(asyncio.run(
                _interactive(base, key, args.rate, args.seconds, seed=1 + r)))
            batch = _submit(client, args.lines)
            _wait_running(client, batch.id)
            rounds["with_batch"].append(asyncio.run(
                _interactive(base, key, args.rate, args.seconds, seed=1 + r)))
            rounds["with_batch"][-1]["batch_lines_done"] = _stop_batch(client, batch.id)
            print(f"round {r}: p95 alone {rounds['alone'][-1]['ttft_p95_s']:.4f} with batch "
                  f"{rounds['with_batch'][-1]['ttft_p95_s']:.4f}", flush=True)
        throughput = _throughput(client, args.lines)
    finally:
        _stop(proc)

    def pooled(kind: str, q: float) -> float | None:
        value = _pct([t for x in rounds[kind] for t in x["ttfts"]], q)
        return None if value is None else round(value, 4)

    alone, loaded = pooled("alone", 0.95), pooled("with_batch", 0.95)
    figures = {f"ttft_p{int(q * 100)}_{label}_s": pooled(kind, q) for q in (0.5, 0.99)
               for kind, label in (("alone", "alone"), ("with_batch", "with_batch"))}
    for kind in rounds:
        for x in rounds[kind]:
            x.pop("ttfts")
    result = {
        "interactive_rate_per_s": args.rate, "interactive_seconds": args.seconds,
        "rounds_each": args.rounds, "batch_lines": args.lines,
        "batch_concurrency": args.concurrency,
        "ttft_p95_alone_s": alone, "ttft_p95_with_batch_s": loaded,
        "ttft_p95_increase": None if not alone or loaded is None else
        round(loaded / alone - 1, 3),
        **figures,
        "interactive_failures": sum(x["failures"] for k in rounds for x in rounds[k]),
        "batch_throughput_light": throughput, "rounds": rounds, "machine": machine(),
    }
    print(json.dumps(result, indent=2))
    write_result("batch" if args.concurrency is None else f"batch_c{args.concurrency}",
                 result)


if __name__ == "__main__":
    main()
