"""Chat Completions, Responses and Messages (issue 37): the web tier's CPU per request and the
time to first token for the same workload through each API, in one run.

Each protocol's view translates its body into a chat body and runs it through the one
pipeline (inference/pipeline.py), so the goal is each API within 5% of chat, in web CPU per
request and in TTFT. One `atrium web` process and one `atrium engine` on the demo
checkpoint (the trained demo model `atrium up` builds; its answers stop early, at EOS), on
a Redis server of their own, SQLite in a fresh ATRIUM_HOME. The same requests go through:

- ``chat``: ``POST /v1/chat/completions``, ``max_completion_tokens``, and with
  ``stream_options.include_usage`` when streamed (Responses and Messages end with usage too);
- ``responses``: ``POST /v1/responses``, ``input`` a string, ``max_output_tokens``, stored
  (the API's default: the response is saved for ``previous_response_id``);
- ``responses_nostore``: the same with ``"store": false``, the work chat does and no more;
- ``messages``: ``POST /v1/messages``, ``max_tokens``, the key in ``x-api-key``.

Same model, same user texts (a few, cycled alike in every protocol), same max tokens,
temperature 0; streamed (TTFT at the first text delta: chat ``choices[0].delta.content``,
Responses ``response.output_text.delta``, Messages ``content_block_delta``) and not, at each
concurrency. Clients are httpx (async) with SSE parsed here, not the SDKs. The protocols
alternate in blocks: in each round, each condition (stream or not, concurrency) runs one
block per protocol, in an order that turns from round to round, so drift reaches them
alike. The web process's CPU (every thread's time on a CPU, /proc/<pid>/task/*/schedstat,
checked over the run against /proc/<pid>/stat's user + system) is read before a block and
after it, once the block's request logs are written (``--settle``). Per protocol: web CPU
ms per request (its blocks' CPU / their requests), TTFT p50/p95/p99, total latency p50,
and the ratio of each to chat's; the per-round ratios' median, range and standard error
show the spread. About 3.5 minutes on the 2-core VM. Writes bench/results/protocols.json.

    .venv/bin/python bench/protocols.py [--requests 240] [--rounds 12] [--concurrency 1 8]
        [--models DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from bench.concurrency import BIN, MODEL, _cli, _cpu_s, wait_ready  # noqa: E402
from bench.workload import machine, percentile  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

PROTOCOLS = ("chat", "responses", "responses_nostore", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses",
         "responses_nostore": "/v1/responses", "messages": "/v1/messages"}
TEXTS = ("Tell me a story about the old fox near the river.",
         "What does the baker carry to the market in the morning?",
         "Describe the quiet village on the hill in winter.",
         "Who watches the boats at the harbour every day?")
GOAL_RATIO = 1.05


# --- the requests, in each protocol ---------------------------------------------------------

def body(protocol: str, text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    if protocol == "chat":
        out: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}],
                               "max_completion_tokens": max_tokens, "temperature": 0,
                               "stream": stream}
        if stream:
            out["stream_options"] = {"include_usage": True}
        return out
    if protocol.startswith("responses"):
        out = {"model": MODEL, "input": text, "max_output_tokens": max_tokens,
               "temperature": 0, "stream": stream}
        if protocol == "responses_nostore":
            out["store"] = False
        return out
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": text}]}


def headers(protocol: str, key: str) -> dict[str, str]:
    if protocol == "messages":
        return {"x-api-key": key, "anthropic-version": "2023-06-01"}
    return {"Authorization": f"Bearer {key}"}


def delta_text(protocol: str, event: dict[str, Any]) -> str:
    """The text a streamed event adds ("" for every other event)."""
    if protocol == "chat":
        choices = event.get("choices") or []
        return (choices[0].get("delta") or {}).get("content") or "" if choices else ""
    if protocol.startswith("responses"):
        return event.get("delta") or "" if event.get("type") == \
            "response.output_text.delta" else ""
    if event.get("type") == "content_block_delta":
        return (event.get("delta") or {}).get("text") or ""
    return ""


def stream_usage(protocol: str, event: dict[str, Any]) -> int | None:
    """Output tokens, from the event that carries them (None otherwise)."""
    if protocol == "chat":
        return (event.get("usage") or {}).get("completion_tokens")
    if protocol.startswith("responses"):
        if event.get("type") in ("response.completed", "response.incomplete"):
            return event["response"]["usage"]["output_tokens"]
        return None
    if event.get("type") == "message_delta":
        return (event.get("usage") or {}).get("output_tokens")
    return None


def answer(protocol: str, data: dict[str, Any]) -> tuple[str, int]:
    """A non-streamed answer's text and output tokens."""
    if protocol == "chat":
        return data["choices"][0]["message"]["content"] or "", \
            data["usage"]["completion_tokens"]
    if protocol.startswith("responses"):
        text = "".join(part.get("text", "") for item in data["output"]
                       if item["type"] == "message" for part in item["content"])
        return text, data["usage"]["output_tokens"]
    return "".join(b.get("text", "") for b in data["content"]), data["usage"]["output_tokens"]


def error_of(protocol: str, event: dict[str, Any]) -> str | None:
    if "error" in event and protocol != "messages":
        return str(event["error"])
    if event.get("type") in ("error", "response.failed"):
        return json.dumps(event)[:300]
    return None


def cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run, to the nanosecond (each thread's
    /proc/<pid>/task/<tid>/schedstat): /proc/<pid>/stat counts in 10 ms ticks, too coarse for
    a block of a few dozen requests. A thread that ends takes its time with it; the web
    process's threads live as long as it does, and the run's total is checked against
    /proc/<pid>/stat (``cpu_check``)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


# --- one request, one block -----------------------------------------------------------------

async def one(client: httpx.AsyncClient, protocol: str, key: str, text: str,
              max_tokens: int, stream: bool, out: dict[str, Any]) -> None:
    payload = body(protocol, text, max_tokens, stream)
    sent = time.perf_counter()
    first = None
    pieces: list[str] = []
    tokens = None
    try:
        if not stream:
            response = await client.post(PATHS[protocol], json=payload,
                                         headers=headers(protocol, key))
            if response.status_code != 200:
                out["failures"].append(f"{response.status_code}: {response.text[:300]}")
                return
            full, tokens = answer(protocol, response.json())
            pieces.append(full)
        else:
            async with client.stream("POST", PATHS[protocol], json=payload,
                                     headers=headers(protocol, key)) as response:
                if response.status_code != 200:
                    await response.aread()
                    out["failures"].append(f"{response.status_code}: {response.text[:300]}")
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if failure := error_of(protocol, event):
                        out["failures"].append(failure)
                        return
                    if piece := delta_text(protocol, event):
                        if first is None:
                            first = time.perf_counter()
                        pieces.append(piece)
                    tokens = stream_usage(protocol, event) or tokens
    except httpx.HTTPError as exc:
        out["failures"].append(type(exc).__name__)
        return
    done = time.perf_counter()
    if first is not None:
        out["ttft"].append(first - sent)
    out["total"].append(done - sent)
    out["tokens"].append(tokens or 0)
    out["texts"].setdefault(text, set()).add("".join(pieces))


async def block(client: httpx.AsyncClient, protocol: str, key: str, *, requests: int,
                concurrency: int, max_tokens: int, stream: bool, start: int) -> dict:
    out: dict[str, Any] = {"failures": [], "ttft": [], "total": [], "tokens": [], "texts": {}}
    todo = iter(range(start, start + requests))

    async def worker() -> None:
        for i in todo:
            await one(client, protocol, key, TEXTS[i % len(TEXTS)], max_tokens, stream, out)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


# --- the run --------------------------------------------------------------------------------

def _order(protocols: list[str], round_no: int) -> list[str]:
    """Each round starts with another protocol; odd rounds go backwards."""
    turned = protocols[round_no % len(protocols):] + protocols[:round_no % len(protocols)]
    return turned[::-1] if round_no % 2 else turned


async def measure(base: str, key: str, pid: int, args: argparse.Namespace) -> dict:
    conditions = [(stream, c) for stream in (True, False) for c in args.concurrency]
    per_block = max(1, args.requests // args.rounds)  # at concurrency c, at least 2c
    cells: dict[tuple, dict[str, Any]] = {
        (p, s, c): {"cpu_s": 0.0, "requests": 0, "wall_s": 0.0, "failures": [], "ttft": [],
                    "total": [], "tokens": [], "texts": {}, "round_cpu_ms": [],
                    "round_ttft": []}
        for p in args.protocols for s, c in conditions}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        # Warm: the key cache, each protocol's first parse, pools, the engine's prefix cache.
        for protocol in args.protocols:
            for stream, c in conditions:
                await block(client, protocol, key, requests=max(8, 2 * c), concurrency=c,
                            max_tokens=args.max_tokens, stream=stream, start=0)
        await asyncio.sleep(args.settle)
        idle0, idle_t0 = cpu_s(pid), time.monotonic()
        await asyncio.sleep(2.0)
        idle_ms_per_s = (cpu_s(pid) - idle0) * 1000 / (time.monotonic() - idle_t0)
        began, ticks0, fine0 = time.monotonic(), _cpu_s(pid), cpu_s(pid)
        load = [round(os.getloadavg()[0], 2)]
        for round_no in range(args.rounds):
            for stream, c in conditions:
                for protocol in _order(list(args.protocols), round_no):
                    cell = cells[(protocol, stream, c)]
                    n = max(per_block, 2 * c)
                    cpu0, wall0 = cpu_s(pid), time.monotonic()
                    out = await block(client, protocol, key, requests=n,
                                      concurrency=c, max_tokens=args.max_tokens,
                                      stream=stream, start=round_no * n)
                    wall = time.monotonic() - wall0
                    await asyncio.sleep(args.settle)  # the block's request logs written
                    cpu = cpu_s(pid) - cpu0
                    cell["cpu_s"] += cpu
                    cell["requests"] += n
                    cell["wall_s"] += wall
                    cell["round_cpu_ms"].append(cpu * 1000 / n)
                    cell["round_ttft"].append(percentile(out["ttft"], 50) if stream else None)
                    for name in ("failures", "ttft", "total", "tokens"):
                        cell[name] += out[name]
                    for text, answers in out["texts"].items():
                        cell["texts"].setdefault(text, set()).update(answers)
            load.append(round(os.getloadavg()[0], 2))
            print(f"round {round_no + 1}/{args.rounds} done "
                  f"({time.monotonic() - began:.0f} s)", flush=True)
        elapsed = time.monotonic() - began
        check = {"schedstat_s": round(cpu_s(pid) - fine0, 3),
                 "proc_stat_s": round(_cpu_s(pid) - ticks0, 3),
                 "blocks_sum_s": round(sum(c["cpu_s"] for c in cells.values()), 3)}
    return {"cpu_check": check, "load_average_1m_by_round": load, "cells": cells,
            "conditions": conditions, "per_block": per_block,
            "idle_cpu_ms_per_s": round(idle_ms_per_s, 2), "measured_s": round(elapsed, 1)}


def _ms(value: float | None) -> float | None:
    return None if value is None or value != value else round(value * 1000, 2)


def summarize(measured: dict, protocols: list[str]) -> list[dict[str, Any]]:
    cells = measured["cells"]
    rows = []
    for stream, c in measured["conditions"]:
        chat = cells[("chat", stream, c)]
        chat_cpu = chat["cpu_s"] * 1000 / chat["requests"]
        chat_ttft = percentile(chat["ttft"], 50) if stream else None
        chat_total = percentile(chat["total"], 50)
        for protocol in protocols:
            cell = cells[(protocol, stream, c)]
            cpu = cell["cpu_s"] * 1000 / cell["requests"]
            ttft = {f"p{q}": _ms(percentile(cell["ttft"], q)) for q in (50, 95, 99)} \
                if stream else None
            paired = [ours / theirs for ours, theirs in
                      zip(cell["round_cpu_ms"], chat["round_cpu_ms"], strict=True)]
            row = {
                "protocol": protocol, "path": PATHS[protocol], "stream": stream,
                "concurrency": c, "requests": cell["requests"],
                "failures": len(cell["failures"]), "failure_examples": cell["failures"][:3],
                "web_cpu_ms_per_request": round(cpu, 3),
                "web_cpu_ratio_to_chat": round(cpu / chat_cpu, 3),
                "web_cpu_round_ratio_median": round(statistics.median(paired), 3),
                "web_cpu_round_ratio_range": [round(min(paired), 3), round(max(paired), 3)],
                # The rounds' ratios' standard error: how far apart a run's figure can be
                # from the next run's, by chance.
                "web_cpu_round_ratio_stderr": round(statistics.stdev(paired) / len(paired) ** 0.5,
                                                    3) if len(paired) > 1 else None,
                "web_cpu_ms_per_request_rounds": [round(x, 3) for x in cell["round_cpu_ms"]],
                "ttft_ms": ttft,
                "ttft_p50_ratio_to_chat": round(percentile(cell["ttft"], 50) / chat_ttft, 3)
                if stream else None,
                "ttft_p50_round_ratio_median": round(statistics.median(
                    ours / theirs for ours, theirs in zip(cell["round_ttft"], chat["round_ttft"],
                                                          strict=True)), 3) if stream else None,
                "total_ms_p50": _ms(percentile(cell["total"], 50)),
                "total_p50_ratio_to_chat": round(percentile(cell["total"], 50) / chat_total, 3),
                "output_tokens_mean": round(statistics.fmean(cell["tokens"]), 2)
                if cell["tokens"] else None,
                "requests_per_s": round(cell["requests"] / cell["wall_s"], 2),
            }
            row["within_goal"] = bool(
                row["web_cpu_ratio_to_chat"] <= GOAL_RATIO
                and (not stream or row["ttft_p50_ratio_to_chat"] <= GOAL_RATIO))
            rows.append(row)
    return rows


def same_answers(measured: dict, protocols: list[str]) -> dict[str, Any]:
    """Whether every protocol gave the one answer per text (greedy: they should)."""
    cells = measured["cells"]
    seen: dict[str, set[str]] = {}
    for (protocol, _, _), cell in cells.items():
        if protocol in protocols:
            for text, answers in cell["texts"].items():
                seen.setdefault(text, set()).update(answers)
    return {"texts": len(seen), "distinct_answers_per_text": sorted(len(a) for a in seen.values()),
            "example": {t: sorted(a)[:2] for t, a in list(seen.items())[:1]}}


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout


def _code_digest() -> dict[str, str]:
    """What the run measured, file by file: the protocols' and the pipeline's code is being
    changed (uncommitted) while benches run."""
    files = sorted((ROOT / "inference/protocols").glob("*.py")) + [
        ROOT / "inference/pipeline.py", ROOT / "inference/views.py"]
    return {str(f.relative_to(ROOT)): hashlib.sha256(f.read_bytes()).hexdigest()[:12]
            for f in files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=240,
                        help="requests per protocol in each condition (stream or not, each "
                             "concurrency), over all rounds")
    parser.add_argument("--rounds", type=int, default=12,
                        help="blocks per protocol and condition; the order turns each round")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="max tokens in each API's name for it (Responses' least is 16)")
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    parser.add_argument("--settle", type=float, default=0.3,
                        help="seconds after a block before its CPU is read (request logs "
                             "are written in batches 0.25 s apart)")
    parser.add_argument("--models", type=Path, default=ROOT / "var/e2e-models/models",
                        help="a models folder to copy into ATRIUM_HOME, so the demo model "
                             "is not built again (built if absent)")
    parser.add_argument("--database-url", default=None,
                        help="an empty PostgreSQL database to run on (production's), "
                             "instead of a fresh SQLite file (the embedded default)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/protocols.json")
    args = parser.parse_args()
    if "chat" not in args.protocols:
        parser.error("chat is the peer: name it in --protocols")
    args.protocols = ["chat", *(p for p in args.protocols if p != "chat")]

    home = Path(tempfile.mkdtemp(prefix="atrium-protocols-"))
    server = RedisServer(home, persistent=False)
    server.start()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATRIUM_", "DJANGO_", "OTEL_")) and k != "DATABASE_URL"}
    env.update(ATRIUM_HOME=str(home), REDIS_URL=server.url,
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    if args.database_url:
        env["DATABASE_URL"] = args.database_url
    if args.models.is_dir():
        shutil.copytree(args.models, home / "models")
    procs: list[subprocess.Popen] = []
    try:
        model_dir = Path(_cli(env, home, "build-demo-model").splitlines()[-1])
        _cli(env, home, "migrate", "--verbosity", "0")
        _cli(env, home, "create-tenant", "Bench", "--slug", "bench")
        _cli(env, home, "set-limits", "bench", "--max-concurrent-requests", "100000",
             "--requests-per-minute", "1000000", "--tokens-per-minute", "100000000")
        key = _cli(env, home, "create-key", "bench").split()[-1]
        procs.append(subprocess.Popen(
            [str(BIN / "atrium"), "engine", "--model-name", MODEL], env=env, cwd=home,
            stdout=(home / "engine.log").open("w"), stderr=subprocess.STDOUT))
        port = free_port()
        web = subprocess.Popen([str(BIN / "atrium"), "web", "--port", str(port)], env=env,
                               cwd=home, stdout=(home / "web.log").open("w"),
                               stderr=subprocess.STDOUT)
        procs.append(web)
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, web, [home / "web.log", home / "engine.log"], timeout=300)
        measured = asyncio.run(measure(base, key, web.pid, args))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.kill()
    rows = summarize(measured, args.protocols)
    head = _git("rev-parse", "--short", "HEAD").strip()
    dirty = [line[3:] for line in _git("status", "--porcelain", "inference", "platform",
                                       "requestlogs", "tenants").splitlines()]
    result = {
        "machine_note": f"{os.cpu_count()} CPUs (the development VM), CPU only; web, engine, "
                        "Redis and the clients on the same machine",
        "checkpoint": f"{model_dir.name}: the demo model `atrium up` builds (trained; "
                      "answers stop early at EOS), atrium engine as shipped",
        "peer": "chat: POST /v1/chat/completions, the same web process and engine, blocks "
                "alternating with the other protocols in the same run",
        "database": "PostgreSQL (DATABASE_URL, this machine's)" if args.database_url
                    else "SQLite, a fresh file (the embedded default)",
        "revision": {"head": head, "uncommitted": dirty, "sha256_12": _code_digest()},
        "goal": f"each protocol within {round((GOAL_RATIO - 1) * 100)}% of chat in web CPU "
                "per request and in TTFT p50",
        "workload": {"texts": list(TEXTS), "max_tokens": args.max_tokens, "temperature": 0,
                     "requests_per_protocol_and_condition": rows[0]["requests"],
                     "rounds": args.rounds, "block": measured["per_block"],
                     "concurrency": args.concurrency, "settle_s": args.settle,
                     "client": f"httpx {httpx.__version__} (async), SSE parsed by the bench"},
        "web_idle_cpu_ms_per_s": measured["idle_cpu_ms_per_s"],
        "cpu_check": measured["cpu_check"],
        # Others' processes share the VM (tests run beside the bench): the 1-minute load.
        "load_average_1m_by_round": measured["load_average_1m_by_round"],
        "measured_s": measured["measured_s"],
        "same_answers": same_answers(measured, args.protocols),
        "rows": rows,
    }
    # bench/workload.py's layout: benchmark, when, machine, then the result.
    result = {"benchmark": "protocols",
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(f"{row['protocol']:<18} stream={row['stream']!s:<5} c={row['concurrency']:<2} "
              f"cpu {row['web_cpu_ms_per_request']:7.3f} ms (x{row['web_cpu_ratio_to_chat']}, "
              f"rounds x{row['web_cpu_round_ratio_median']}) "
              f"ttft p50 {(row['ttft_ms'] or {}).get('p50')} "
              f"(x{row['ttft_p50_ratio_to_chat']}) total p50 {row['total_ms_p50']} "
              f"fail {row['failures']}", flush=True)
    print(f"-> {args.out}")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
