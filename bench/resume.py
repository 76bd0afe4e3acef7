"""Resumable streams: what a cut and a resume cost, against the same streams read uncut.

Every request is a streamed chat completion sent with ``x-atrium-resumable: 1`` (its SSE
events numbered ``id: 0, 1, ...``; the request outlives its connection). One `atrium web`
and one `atrium engine` on the demo checkpoint (the trained demo model `atrium up` builds;
its answers may stop early, at EOS), on a Redis server of their own, SQLite in a fresh
ATRIUM_HOME. Two conditions, alternating in blocks (the order turns every round, so drift
reaches both alike):

- ``uncut`` (the peer): each stream read to its end;
- ``cut``: each stream cut once, by closing its connection, after a random event (seeded;
  from the first event to the one before the last, as the uncut answer to the same text
  numbers them), then at once resumed with ``GET /v1/streams/{id}`` and ``Last-Event-ID``
  the last id read, and read to its end.

Per condition: completion tokens per second (its blocks' tokens over their wall time; the
goal: cut >= 0.95x uncut), total latency, and the CPU per stream of the web process, the
engine and the clients (this process; all share the machine's cores). For the cut
streams: the resume latency (the GET sent -> its first event read; goal p99 < 1 s), and
lost and duplicated events (the joined ids against 0..n-1 without gap or repeat, and the
stream ended by its usage chunk and ``[DONE]``; goal 0 and 0), and text mismatches (the
joined text against the uncut greedy answer to the same text). Redis memory a resumable
stream leaves behind (kept ATRIUM_RESUME_RETENTION_S after its end): ``MEMORY USAGE`` of
its record and of the engine's events stream, for every finished request, and the run's
``used_memory`` delta per stream as a second estimate. About 40 s on the 2-core VM.
Writes bench/results/resume.json.

With ``--pin`` the engine runs alone on CPU 1 and everything else on CPU 0: on two shared
cores the web process's CPU for a resume (one more HTTP request) is taken from the engine's
decode, which a deployment's web tier, on machines of its own, is not.

    .venv/bin/python bench/resume.py [--requests 200] [--rounds 10] [--concurrency 8]
        [--max-tokens 64] [--ignore-eos] [--pin] [--models DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]
from bench.concurrency import BIN, MODEL, _cli, _cpu_s, wait_ready  # noqa: E402
from bench.protocols import TEXTS, cpu_s  # noqa: E402
from bench.workload import machine, percentile  # noqa: E402
from engine.protocol import events_stream  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

CONDITIONS = ("uncut", "cut")
RESUMABLE = {"x-atrium-resumable": "1"}
GOAL_RESUME_P99_S = 1.0
GOAL_THROUGHPUT_RATIO = 0.95


# --- one stream -------------------------------------------------------------------------------

@dataclass(slots=True)
class Stream:
    """What a client read of one request, over one connection or two."""

    text: str
    cut_after: int | None  # the event id after which the connection is closed
    request_id: str = ""
    ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    done: bool = False  # "data: [DONE]" read
    cut: bool = False  # the connection was closed after cut_after, and resumed
    resume_s: float | None = None
    total_s: float = 0.0
    failure: str | None = None


async def sse(response: httpx.Response) -> AsyncIterator[tuple[int | None, str]]:
    """Each event's id and data."""
    event_id, data = None, []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


async def read(response: httpx.Response, out: Stream, *, cut_after: int | None) -> float | None:
    """Reads ``response``'s events into ``out``; stops after event ``cut_after`` (the caller
    closes the connection). When the first event arrived."""
    first = None
    async with contextlib.aclosing(sse(response)) as events:
        async for event_id, data in events:
            first = first or time.perf_counter()
            if data == "[DONE]":
                out.done = True  # read on to the body's end: the connection is kept
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                out.failure = json.dumps(chunk["error"])[:300]
                return first
            out.ids.append(event_id if event_id is not None else -1)
            for choice in chunk.get("choices") or ():
                out.pieces.append((choice.get("delta") or {}).get("content") or "")
            out.tokens = (chunk.get("usage") or {}).get("completion_tokens") or out.tokens
            if cut_after is not None and event_id == cut_after:
                out.cut = True
                return first
    return first


def _limits(args: argparse.Namespace) -> dict:
    """The answers' length: max_tokens, and ignore_eos when asked (the demo model's answers
    otherwise stop at EOS after about 20 tokens)."""
    return {"max_tokens": args.max_tokens, **({"ignore_eos": True} if args.ignore_eos else {})}


async def one(client: httpx.AsyncClient, key: str, out: Stream, limits: dict) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": out.text}],
            **limits, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={**auth, **RESUMABLE}) as response:
            if response.status_code != 200:
                await response.aread()
                out.failure = f"{response.status_code}: {response.text[:300]}"
                return
            out.request_id = response.headers["x-request-id"]
            await read(response, out, cut_after=out.cut_after)
        # Leaving the block mid-body closes the connection: the client is gone.
        if out.cut:
            resent = time.perf_counter()
            async with client.stream("GET", f"/v1/streams/{out.request_id}",
                                     headers={**auth, "Last-Event-ID": str(out.ids[-1])}
                                     ) as response:
                if response.status_code != 200:
                    await response.aread()
                    out.failure = f"resume {response.status_code}: {response.text[:300]}"
                    return
                first = await read(response, out, cut_after=None)
            out.resume_s = None if first is None else first - resent
    except httpx.HTTPError as exc:
        out.failure = type(exc).__name__
        return
    out.total_s = time.perf_counter() - sent


def gaps_and_repeats(stream: Stream) -> tuple[int, int]:
    """Events missing from the joined ids 0..n-1 (a gap, or an end never read), and events
    read twice."""
    seen = set(stream.ids)
    lost = (max(seen) + 1 - len(seen)) if seen else 0
    lost += 0 if stream.done and stream.tokens else 1
    return lost, len(stream.ids) - len(seen)


# --- blocks and the run -----------------------------------------------------------------------

async def block(client: httpx.AsyncClient, key: str, streams: list[Stream], *,
                concurrency: int, limits: dict) -> None:
    todo = iter(streams)

    async def worker() -> None:
        for stream in todo:
            await one(client, key, stream, limits)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def plan(condition: str, start: int, n: int, events: dict[str, int],
         rng: random.Random) -> list[Stream]:
    """A block's streams; a cut one is cut after an event from the first to the one before
    the last (as the uncut answer to its text numbers them)."""
    out = []
    for i in range(start, start + n):
        text = TEXTS[i % len(TEXTS)]
        cut = rng.randint(0, max(0, events[text] - 2)) if condition == "cut" else None
        out.append(Stream(text, cut))
    return out


def cpu_now(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of the web and engine processes, and of this one (the clients)."""
    return {**{name: cpu_s(pid) for name, pid in pids.items()}, "client": time.process_time()}


async def measure(base: str, key: str, pids: dict[str, int],
                  args: argparse.Namespace) -> dict[str, Any]:
    """``pids``: the web process's and the engine's."""
    pid = pids["web"]
    rng = random.Random(args.seed)
    per_block = max(1, args.requests // args.rounds)
    cells: dict[str, dict[str, Any]] = {
        c: {"streams": [], "wall_s": 0.0, "cpu_s": dict.fromkeys([*pids, "client"], 0.0),
            "round_tokens_per_s": []}
        for c in CONDITIONS}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        # Warm (the key cache, pools, the engine's prefix cache), and the uncut answers.
        warm = [Stream(TEXTS[i % len(TEXTS)], None) for i in range(2 * len(TEXTS))]
        await block(client, key, warm, concurrency=args.concurrency,
                    limits=_limits(args))
        if failed := [s.failure for s in warm if s.failure]:
            raise SystemExit(f"the warm-up failed: {failed[:3]}")
        reference = {s.text: "".join(s.pieces) for s in warm}
        events = {s.text: len(s.ids) for s in warm}
        await block(client, key, plan("cut", 0, 2 * args.concurrency, events, rng),
                    concurrency=args.concurrency, limits=_limits(args))
        redis_client = redis.Redis.from_url(args.redis_url)
        used0, keys0 = redis_client.info("memory")["used_memory"], redis_client.dbsize()
        began, ticks0 = time.monotonic(), _cpu_s(pid)
        for round_no in range(args.rounds):
            order = CONDITIONS if round_no % 2 == 0 else CONDITIONS[::-1]
            for condition in order:
                cell = cells[condition]
                streams = plan(condition, round_no * per_block, per_block, events, rng)
                cpu0, wall0 = cpu_now(pids), time.monotonic()
                await block(client, key, streams, concurrency=args.concurrency,
                            limits=_limits(args))
                wall = time.monotonic() - wall0
                for name, seconds in cpu_now(pids).items():
                    cell["cpu_s"][name] += seconds - cpu0[name]
                cell["wall_s"] += wall
                cell["streams"] += streams
                cell["round_tokens_per_s"].append(sum(s.tokens for s in streams) / wall)
            print(f"round {round_no + 1}/{args.rounds} done "
                  f"({time.monotonic() - began:.0f} s)", flush=True)
        elapsed = time.monotonic() - began
        web_cpu_check_s = round(_cpu_s(pid) - ticks0, 2)
        await asyncio.sleep(1.0)  # the last owners let go of their leases
        used1, keys1 = redis_client.info("memory")["used_memory"], redis_client.dbsize()
    finished = [s for c in CONDITIONS for s in cells[c]["streams"] if s.request_id]
    return {"cells": cells, "reference": reference, "events": events, "per_block": per_block,
            "measured_s": round(elapsed, 1), "web_cpu_check_s": web_cpu_check_s,
            "redis": redis_memory(redis_client, finished, used1 - used0, keys1 - keys0)}


def redis_memory(client: redis.Redis, finished: list[Stream], used_delta: int,
                 keys_delta: int) -> dict[str, Any]:
    """What the finished resumable streams keep in Redis: MEMORY USAGE of each one's record
    and events stream, and the run's used_memory delta per stream."""
    from inference.resumable import LIVE_KEY, OWNERS_KEY, record_key

    pipe = client.pipeline(transaction=False)
    for s in finished:
        pipe.memory_usage(record_key(s.request_id), samples=0)
        pipe.memory_usage(events_stream(MODEL, s.request_id), samples=0)
        pipe.xlen(events_stream(MODEL, s.request_id))
        pipe.ttl(record_key(s.request_id))
        pipe.ttl(events_stream(MODEL, s.request_id))
    replies = pipe.execute()
    record, events, lengths, record_ttl, events_ttl = (replies[i::5] for i in range(5))
    both = [r + e for r, e in zip(record, events, strict=True) if r and e]
    return {
        "streams": len(finished), "with_both_keys": len(both),
        "record_bytes_mean": _mean([r for r in record if r]),
        "events_stream_bytes_mean": _mean([e for e in events if e]),
        "events_stream_entries_mean": _mean(lengths),
        "bytes_per_stream_mean": _mean(both),
        "record_ttl_s_min": min(record_ttl), "events_ttl_s_min": min(events_ttl),
        "used_memory_delta_bytes": used_delta, "keys_delta": keys_delta,
        "used_memory_delta_per_stream": round(used_delta / len(finished), 1),
        "live_zset_left": client.zcard(LIVE_KEY), "owners_hash_left": client.hlen(OWNERS_KEY),
    }


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 1) if values else None


# --- the figures ------------------------------------------------------------------------------

def condition_row(name: str, cell: dict[str, Any], reference: dict[str, str]) -> dict[str, Any]:
    streams = cell["streams"]
    ok = [s for s in streams if not s.failure]
    lost = duplicated = mismatches = 0
    for s in ok:
        gaps, repeats = gaps_and_repeats(s)
        lost += gaps
        duplicated += repeats
        mismatches += "".join(s.pieces) != reference[s.text]
    tokens = sum(s.tokens for s in ok)
    resume = [s.resume_s for s in ok if s.resume_s is not None]
    rounds = cell["round_tokens_per_s"]
    return {
        "condition": name, "streams": len(streams),
        "failures": len(streams) - len(ok),
        "failure_examples": [s.failure for s in streams if s.failure][:3],
        "cut_and_resumed": sum(s.cut for s in ok),
        "lost_events": lost, "duplicated_events": duplicated, "text_mismatches": mismatches,
        "completion_tokens_mean": round(tokens / len(ok), 2) if ok else None,
        "events_mean": round(statistics.fmean(len(set(s.ids)) for s in ok), 2) if ok else None,
        "completion_tokens_per_s": round(tokens / cell["wall_s"], 1),
        "round_tokens_per_s": [round(x, 1) for x in rounds],
        "total_ms_p50": round(1000 * percentile([s.total_s for s in ok], 50), 1),
        "total_ms_p99": round(1000 * percentile([s.total_s for s in ok], 99), 1),
        "cpu_ms_per_stream": {name: round(seconds * 1000 / len(streams), 2)
                              for name, seconds in cell["cpu_s"].items()},
        "wall_s": round(cell["wall_s"], 2),
        **({f"resume_p{q}_s": round(percentile(resume, q), 4) for q in (50, 95, 99)} | {
            "resume_max_s": round(max(resume), 4), "resumes": len(resume)} if resume else {}),
    }


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout


def _code_digest() -> dict[str, str]:
    """What the run measured: the feature is uncommitted while benches run."""
    files = [ROOT / f"inference/{name}.py" for name in
             ("resumable", "resume", "frames", "views", "dispatch", "pipeline")]
    return {str(f.relative_to(ROOT)): hashlib.sha256(f.read_bytes()).hexdigest()[:12]
            for f in files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200,
                        help="streams per condition (uncut, cut), over all rounds")
    parser.add_argument("--rounds", type=int, default=10,
                        help="blocks per condition; the order turns each round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every answer runs to --max-tokens (vLLM's ignore_eos)")
    parser.add_argument("--seed", type=int, default=7, help="where the streams are cut")
    parser.add_argument("--models", type=Path, default=ROOT / "var/e2e-models/models",
                        help="a models folder to copy into ATRIUM_HOME, so the demo model "
                             "is not built again (built if absent)")
    parser.add_argument("--pin", action="store_true",
                        help="the engine alone on CPU 1 (one thread), the web process, Redis "
                             "and the clients on CPU 0: the web tier off the engine's cores, "
                             "as it is off the GPU workers' machines in a deployment")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/resume.json")
    args = parser.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {0})  # inherited by Redis and the web process

    home = Path(tempfile.mkdtemp(prefix="atrium-resume-"))
    server = RedisServer(home, persistent=False)
    server.start()
    args.redis_url = server.url
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATRIUM_", "DJANGO_", "OTEL_")) and k != "DATABASE_URL"}
    env.update(ATRIUM_HOME=str(home), REDIS_URL=server.url,
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    # This process reads the resumable keys' names (inference/resumable.py) as the web does.
    os.environ.update(ATRIUM_HOME=str(home), REDIS_URL=server.url,
                      DJANGO_SETTINGS_MODULE="atrium.settings")
    import django

    django.setup()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Django's config logs each request
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
            [str(BIN / "atrium"), "engine", "--model-name", MODEL],
            env={**env, "OMP_NUM_THREADS": "1"} if args.pin else env, cwd=home,
            stdout=(home / "engine.log").open("w"), stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, {1})) if args.pin else None))
        port = free_port()
        web = subprocess.Popen([str(BIN / "atrium"), "web", "--port", str(port)], env=env,
                               cwd=home, stdout=(home / "web.log").open("w"),
                               stderr=subprocess.STDOUT)
        procs.append(web)
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, web, [home / "web.log", home / "engine.log"], timeout=300)
        load0 = os.getloadavg()[0]
        measured = asyncio.run(measure(base, key, {"web": web.pid, "engine": procs[0].pid},
                                       args))
        load1 = os.getloadavg()[0]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.kill()
    uncut, cut = (condition_row(c, measured["cells"][c], measured["reference"])
                  for c in CONDITIONS)
    ratio = cut["completion_tokens_per_s"] / uncut["completion_tokens_per_s"]
    rounds = [c / u for c, u in zip(cut["round_tokens_per_s"], uncut["round_tokens_per_s"],
                                    strict=True)]
    memory = measured["redis"]
    result = {
        "machine_note": f"{os.cpu_count()} CPUs (the development VM), CPU only; web, engine, "
                        "Redis and the clients on the same machine" + (
                            ": the engine alone on CPU 1 (one thread), the web process, "
                            "Redis and the clients on CPU 0" if args.pin else
                            ", sharing its cores"),
        "pinned": args.pin,
        "checkpoint": f"{model_dir.name}: the demo model `atrium up` builds (trained; "
                      "answers may stop early at EOS), atrium engine as shipped",
        "peer": "uncut (its figures under \"uncut\"): the same resumable streams read to "
                "their end without a cut, the same web process and engine, blocks "
                "alternating with the cut ones in one run",
        "revision": {"head": _git("rev-parse", "--short", "HEAD").strip(),
                     "uncommitted": [line[3:] for line in _git(
                         "status", "--porcelain", "inference", "engine").splitlines()],
                     "sha256_12": _code_digest()},
        "goals": {"lost_events": 0, "duplicated_events": 0,
                  "resume_p99_s_below": GOAL_RESUME_P99_S,
                  "throughput_ratio_at_least": GOAL_THROUGHPUT_RATIO},
        "workload": {"texts": list(TEXTS), **_limits(args), "temperature": 0,
                     "streams_per_condition": args.requests, "rounds": args.rounds,
                     "block": measured["per_block"], "concurrency": args.concurrency,
                     "seed": args.seed, "header": RESUMABLE,
                     "uncut_events_per_text": measured["events"],
                     "client": f"httpx {httpx.__version__} (async), SSE parsed by the bench"},
        "lost_events": cut["lost_events"],
        "duplicated_events": cut["duplicated_events"],
        "text_mismatches": cut["text_mismatches"],
        "resume_p50_s": cut.get("resume_p50_s"),
        "resume_p95_s": cut.get("resume_p95_s"),
        "resume_p99_s": cut.get("resume_p99_s"),
        "throughput_ratio": round(ratio, 3),
        "throughput_round_ratio_median": round(statistics.median(rounds), 3),
        "throughput_round_ratio_range": [round(min(rounds), 3), round(max(rounds), 3)],
        "throughput_round_ratio_stderr": round(statistics.stdev(rounds) / len(rounds) ** 0.5, 3)
        if len(rounds) > 1 else None,
        "redis_bytes_per_stream": memory["bytes_per_stream_mean"],
        "redis": memory,
        "completion_tokens_mean": cut["completion_tokens_mean"],
        "uncut": uncut, "cut": cut,
        "web_cpu_check_s": measured["web_cpu_check_s"],
        "load_average_1m": [round(load0, 2), round(load1, 2)],
        "measured_s": measured["measured_s"],
    }
    result["goals_met"] = {
        "lost_events": result["lost_events"] == 0,
        "duplicated_events": result["duplicated_events"] == 0,
        "resume_p99_s": result["resume_p99_s"] is not None
        and result["resume_p99_s"] < GOAL_RESUME_P99_S,
        "throughput_ratio": result["throughput_ratio"] >= GOAL_THROUGHPUT_RATIO}
    # bench/workload.py's layout: benchmark, when, machine, then the result.
    result = {"benchmark": "resume", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in (uncut, cut):
        print(json.dumps({k: v for k, v in row.items() if k != "round_tokens_per_s"}))
    print(json.dumps({k: result[k] for k in (
        "lost_events", "duplicated_events", "text_mismatches", "resume_p50_s", "resume_p99_s",
        "throughput_ratio", "redis_bytes_per_stream", "goals_met")}))
    print(f"-> {args.out}")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
