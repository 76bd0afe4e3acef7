"""Embeddings: how many a second Atrium answers against sentence-transformers' own encode on
the same checkpoint, and what a steady embedding load does to chat's time to first token.

One `atrium web`, one `atrium engine` for the demo embedding model (the demo model's
weights in the sentence-transformers layout, mean pooling, normalised: what `atrium up`
serves) and one for the demo chat model, on a Redis server of their own and SQLite in a
fresh ATRIUM_HOME, all on this machine's cores with the clients.

- Throughput: for batches of 1, 32 and 256 short inputs (one to two dozen tokens each),
  --clients concurrent clients each send `POST /v1/embeddings` with one batch after
  another (httpx, async) for --seconds; embeddings per second. The peer, in the same run
  and on the same cores: `SentenceTransformer(dir).encode(batch)` on the same batches,
  one call after another (what a process serving them with sentence-transformers does;
  its calls do not overlap), and, as its best case, all of a round's inputs in one call.
  Every Atrium vector is checked against the peer's (max abs difference).
- Interference: streamed chat probes one after another (time to the first content
  token), alone and then beside a steady embedding load (--load-clients clients sending
  batches of 32, from a process of their own); p50 and p99 and their ratio (goal p99 <=
  1.10x).
- The engines run with the threads `atrium up` gives two engines on this host's cores
  (--engine-threads).

Writes bench/results/embeddings.json.

    .venv/bin/python bench/embeddings.py [--seconds 10] [--clients 32] [--probes 200]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
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
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]
from bench.concurrency import BIN, _cli, wait_ready  # noqa: E402
from bench.workload import machine, percentile  # noqa: E402
from engine.options import threads_each  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

CHAT, EMBEDDER = "atrium-demo", "atrium-demo-embedding"
BATCHES = (1, 32, 256)
WORDS = ("river fox baker market morning village hill winter boats harbour bread quiet "
         "story old carries watches every day near the in a of").split()
GOAL_SPEEDUP_AT_32 = 2.0
GOAL_TTFT_P99_RATIO = 1.10


def texts(n: int, seed: int) -> list[str]:
    """``n`` short inputs, each a different run of the demo corpus's words."""
    out = []
    for i in range(n):
        k = (seed * 7919 + i * 104729) % 1000
        length = 4 + k % 12
        out.append(" ".join(WORDS[(k + j * 3) % len(WORDS)] for j in range(length)))
    return out


# --- Atrium ---------------------------------------------------------------------------------

async def atrium_rate(base: str, key: str, batch: int, clients: int, seconds: float
                      ) -> tuple[float, list[list[np.ndarray]], list[list[str]], int]:
    """Embeddings a second from ``clients`` clients sending ``batch`` inputs each call."""
    sent: list[list[str]] = []
    got: list[list[np.ndarray]] = []
    failures = 0
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        stop = time.monotonic() + seconds

        async def one(c: int) -> int:
            nonlocal failures
            done, n = 0, 0
            while time.monotonic() < stop:
                inputs = texts(batch, seed=c * 1000 + n)
                n += 1
                answer = await client.post("/v1/embeddings", json={
                    "model": EMBEDDER, "input": inputs, "encoding_format": "base64"})
                if answer.status_code != 200:
                    failures += 1
                    continue
                vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                           for d in answer.json()["data"]]
                if len(sent) < 8:  # a sample, checked against the peer
                    sent.append(inputs)
                    got.append(vectors)
                done += len(vectors)
            return done

        began = time.monotonic()
        counts = await asyncio.gather(*(one(c) for c in range(clients)))
        wall = time.monotonic() - began
    return sum(counts) / wall, got, sent, failures


async def ttft_probes(base: str, key: str, probes: int) -> list[float]:
    """Streamed chats one after another: seconds to each one's first content token."""
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=120,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        for i in range(probes):
            began = time.monotonic()
            async with client.stream("POST", "/v1/chat/completions", json={
                    "model": CHAT, "stream": True, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Tell me story {i}."}]}) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {") and '"content":' in line:
                        out.append(time.monotonic() - began)
                        break
                async for _ in lines:  # read to its end: the next probe starts after it
                    pass
    return out


def ttft_under_load(base: str, key: str, probes: int, load_clients: int
                    ) -> tuple[list[float], float, dict[str, int]]:
    """The probes beside ``load_clients`` clients embedding batches of 32 without pause, in
    a process of their own (another tenant's application, not the prober's event loop);
    the load's embeddings a second while the probes ran."""
    context = multiprocessing.get_context("spawn")
    measuring, stop, results = context.Event(), context.Event(), context.Queue()
    loader = context.Process(target=_load, args=(base, key, load_clients, measuring, stop,
                                                 results))
    loader.start()
    try:
        time.sleep(3.0)  # the load is steady before the first probe
        measuring.set()
        result = asyncio.run(ttft_probes(base, key, probes))
    finally:
        stop.set()
    rate, statuses = results.get(timeout=120)
    loader.join(timeout=30)
    return result, rate, statuses


def _load(base: str, key: str, clients: int, measuring: Any, stop: Any, results: Any) -> None:
    results.put(asyncio.run(_embed_until(base, key, clients, measuring, stop)))


async def _embed_until(base: str, key: str, clients: int, measuring: Any, stop: Any
                       ) -> tuple[float, dict[str, int]]:
    done, statuses = 0, {}

    async def load(c: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=base, timeout=120,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            n = 0
            while not stop.is_set():
                answer = await client.post("/v1/embeddings", json={
                    "model": EMBEDDER, "input": texts(32, seed=50_000 + c * 1000 + n),
                    "encoding_format": "base64"})  # as the openai package asks
                n += 1
                if measuring.is_set():
                    done += 32 if answer.status_code == 200 else 0
                    status = str(answer.status_code)
                    statuses[status] = statuses.get(status, 0) + 1

    loaders = [asyncio.ensure_future(load(c)) for c in range(clients)]
    while not measuring.is_set():
        await asyncio.sleep(0.05)
    began = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.05)
    seconds = time.monotonic() - began
    await asyncio.gather(*loaders, return_exceptions=True)
    return done / seconds, statuses


# --- the peer -------------------------------------------------------------------------------

def peer_rate(model: Any, batch: int, seconds: float) -> float:
    """sentence-transformers' encode on ``batch`` inputs a call, calls one after another."""
    done, n = 0, 0
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        done += len(model.encode(texts(batch, seed=n), convert_to_numpy=True,
                                 batch_size=max(batch, 32)))
        n += 1
    return done / (time.monotonic() - began)


def peer_one_call(model: Any, total: int) -> float:
    """Its best case: ``total`` inputs in one encode call."""
    inputs = texts(total, seed=99)
    began = time.monotonic()
    model.encode(inputs, convert_to_numpy=True, batch_size=256)
    return total / (time.monotonic() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per batch size")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--load-clients", type=int, default=4)
    parser.add_argument("--engine-threads", type=int, default=threads_each(2),
                        help="each engine's --threads (default: what `atrium up` gives two "
                             "engines on this host; 0: torch's default, one a core)")
    parser.add_argument("--models", type=Path, default=ROOT / "var/e2e-models/models",
                        help="a models folder to copy into ATRIUM_HOME (built if absent)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/embeddings.json")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="atrium-embeddings-"))
    server = RedisServer(home, persistent=False)
    server.start()
    if args.models.is_dir():
        shutil.copytree(args.models, home / "models")
    from engine.demo_model import ensure_demo_embedding_model, ensure_demo_model

    embedder_dir, chat_dir = ensure_demo_embedding_model(home), ensure_demo_model(home)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATRIUM_", "DJANGO_", "OTEL_")) and k != "DATABASE_URL"}
    env.update(ATRIUM_HOME=str(home), REDIS_URL=server.url,
               ATRIUM_MODELS=f"{CHAT}={chat_dir},{EMBEDDER}={embedder_dir}",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    procs: list[subprocess.Popen] = []
    try:
        _cli(env, home, "migrate", "--verbosity", "0")
        _cli(env, home, "create-tenant", "Bench", "--slug", "bench")
        _cli(env, home, "set-limits", "bench", "--max-concurrent-requests", "100000",
             "--requests-per-minute", "1000000", "--tokens-per-minute", "1000000000")
        key = _cli(env, home, "create-key", "bench").split()[-1]
        for name in (CHAT, EMBEDDER):
            procs.append(subprocess.Popen(
                [str(BIN / "atrium"), "engine", "--model-name", name, "--threads",
                 str(args.engine_threads)], env=env, cwd=home,
                stdout=(home / f"engine-{name}.log").open("w"), stderr=subprocess.STDOUT))
        port = free_port()
        web = subprocess.Popen([str(BIN / "atrium"), "web", "--port", str(port)], env=env,
                               cwd=home, stdout=(home / "web.log").open("w"),
                               stderr=subprocess.STDOUT)
        procs.append(web)
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, web, [home / "web.log", *home.glob("engine-*.log")], timeout=300)
        result = measure(base, key, embedder_dir, args)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.kill()
    result = {"benchmark": "embeddings",
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("throughput", "ttft", "goals_met")}, indent=1))
    print(f"-> {args.out}")
    shutil.rmtree(home, ignore_errors=True)


def measure(base: str, key: str, embedder_dir: Path, args: argparse.Namespace
            ) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    peer = SentenceTransformer(str(embedder_dir), device="cpu")
    # Warm both: the engines' first batches, the peer's first call.
    asyncio.run(atrium_rate(base, key, 4, 2, 1.0))
    peer.encode(texts(8, seed=1))
    rows, worst = [], 0.0
    for batch in BATCHES:
        rate, got, sent, failures = asyncio.run(
            atrium_rate(base, key, batch, args.clients, args.seconds))
        for inputs, vectors in zip(sent, got, strict=True):
            expected = peer.encode(inputs, convert_to_numpy=True)
            worst = max(worst, float(np.abs(np.array(vectors) - expected).max()))
        peer_serial = peer_rate(peer, batch, args.seconds)
        rows.append({"batch": batch, "clients": args.clients,
                     "atrium_embeddings_per_s": round(rate, 1), "atrium_failures": failures,
                     "peer_embeddings_per_s": round(peer_serial, 1),
                     "speedup": round(rate / peer_serial, 2)})
        print(json.dumps(rows[-1]), flush=True)
    one_call = peer_one_call(peer, 2048)
    alone = asyncio.run(ttft_probes(base, key, args.probes))
    loaded, load_rate, load_statuses = ttft_under_load(base, key, args.probes,
                                                       args.load_clients)
    ttft = {"alone_p50_ms": round(1000 * statistics.median(alone), 1),
            "alone_p99_ms": round(1000 * percentile(alone, 99), 1),
            "loaded_p50_ms": round(1000 * statistics.median(loaded), 1),
            "loaded_p99_ms": round(1000 * percentile(loaded, 99), 1),
            "probes": len(alone), "load_clients": args.load_clients, "load_batch": 32,
            "load_embeddings_per_s": round(load_rate, 1),
            "load_answers_by_status": load_statuses}
    ttft["p99_ratio"] = round(ttft["loaded_p99_ms"] / ttft["alone_p99_ms"], 3)
    at_32 = next(r for r in rows if r["batch"] == 32)
    return {
        "machine_note": f"{os.cpu_count()} CPUs (the development VM), CPU only; web, both "
                        "engines, Redis, the clients and the peer on the same cores",
        "engine_threads": args.engine_threads or "torch default",
        "checkpoint": f"{embedder_dir.name}: the demo embedding model (the demo model's "
                      "weights, sentence-transformers layout, mean pooling, normalised)",
        "peer": f"sentence-transformers {_version('sentence_transformers')} encode() on the "
                f"same checkpoint, torch {torch.__version__}, in this process, calls one "
                "after another",
        "throughput": rows,
        "peer_one_call_2048_per_s": round(one_call, 1),
        "max_abs_difference_to_peer": worst,
        "ttft": ttft,
        "goals": {"speedup_at_32_at_least": GOAL_SPEEDUP_AT_32,
                  "ttft_p99_ratio_at_most": GOAL_TTFT_P99_RATIO},
        "goals_met": {"speedup_at_32": at_32["speedup"] >= GOAL_SPEEDUP_AT_32,
                      "ttft_p99": ttft["p99_ratio"] <= GOAL_TTFT_P99_RATIO},
    }


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
