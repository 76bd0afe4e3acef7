"""Routing: cache- and adapter-aware placement against random placement, three engines.

Three engine worker processes (``python -m engine.worker``: the demo model on the CPU,
one thread each) serve one model through Redis. Each engine's KV cache holds about
--kv-blocks blocks (fewer than the workload's prefixes fill, as on a loaded GPU) and
--max-cpu-loras adapters in memory. Eight tenants, each with its own 1,000-token
system prompt, send requests (the system prompt and a fresh 24-token user turn)
whose adapter is drawn Zipf-like from six; tenants too are drawn Zipf-like. Arrivals
are Poisson (open loop) at --rate a second.

Each request is placed as the web tier places it (``inference.routing.Router`` over
the engines' heartbeats, read as ``inference/dispatch.py`` reads them): policy
``scored`` against ``random``, the same arrival trace under both, the engines
restarted (caches empty) before each run, the runs alternated over --rounds.

Reported per policy: the prefix hit rate (prompt tokens the engines served from
their caches over all prompt tokens, from each request's usage), TTFT p50/p95 (XADD
to the first token's event), adapter loads from the store (the engines' counts) and
requests an idle engine took from a busy one; the hit rate and TTFT again over the
second half of the requests, once each engine has seen the tenants it serves.

    .venv/bin/python bench/routing.py [--rate 6] [--seconds 180] [--rounds 1] [--kv-blocks N]

writes bench/results/routing.json (routing_kvN.json with another --kv-blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from bench.workload import write_result  # noqa: E402
from engine import protocol  # noqa: E402
from inference.routing import Placement, Router  # noqa: E402

MODEL = "bench"
ENGINES = 3
TENANTS = 8
ADAPTERS = 6
PREFIX = 1000
SUFFIX = 24
OUTPUT = 8
KV_BLOCK_BYTES = 2 * 4 * 4 * 32 * 16 * 4  # k and v, 4 layers, 4 KV heads of 32, 16 tokens


@dataclass
class Sent:
    request: protocol.EngineRequest
    placement: Placement
    at: float  # the XADD, monotonic
    first: float | None = None
    usage: dict = field(default_factory=dict)
    engine: str = ""


def zipf(n: int, s: float) -> list[float]:
    weights = [1 / (k ** s) for k in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def trace(args: argparse.Namespace, vocab: int, adapters: list[str]) -> list[tuple[float, dict]]:
    """(arrival second, the request's parts), the same for every policy."""
    rng = random.Random(7)
    systems = [[rng.randrange(10, vocab) for _ in range(PREFIX)] for _ in range(TENANTS)]
    tenant_w, adapter_w = zipf(TENANTS, 0.8), zipf(ADAPTERS, 1.2)
    at, out = 0.0, []
    while at < args.seconds:
        at += rng.expovariate(args.rate)
        tenant = rng.choices(range(TENANTS), tenant_w)[0]
        adapter = rng.choices(adapters, adapter_w)[0]
        turn = [rng.randrange(10, vocab) for _ in range(SUFFIX)]
        out.append((at, {"tenant": tenant, "adapter": adapter,
                         "prompt": systems[tenant] + turn}))
    return out


class Fleet:
    """Three engine processes on a private Redis database."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, store: Path) -> None:
        self.args, self.model_dir, self.store = args, model_dir, store
        self.client = redis.Redis.from_url(args.redis_url)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        self.client.flushdb()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(sys.path)}
        mib = max(1, self.args.kv_blocks * KV_BLOCK_BYTES // 2**20)
        for i in range(ENGINES):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "engine.worker", "--redis-url", self.args.redis_url,
                 "--model-dir", str(self.model_dir), "--model-name", MODEL,
                 "--engine-id", f"bench-{i}", "--device", "cpu", "--kv-cache-mib", str(mib),
                 "--adapter-store", str(self.store), "--max-loras", "2",
                 "--max-cpu-loras", str(self.args.max_cpu_loras), "--max-lora-rank", "8",
                 "--max-num-batched-tokens", "1024", "--drain-seconds", "0",
                 "--log-level", "WARNING"], env=env, stdout=subprocess.DEVNULL))
        deadline = time.monotonic() + 300
        while len(self.beats()) < ENGINES:
            assert time.monotonic() < deadline, "the engines did not start"
            assert all(p.poll() is None for p in self.procs), "an engine exited"
            time.sleep(0.2)

    def stop(self) -> dict[str, int]:
        beats = self.beats()
        totals = {"adapter_loads": 0, "stolen": 0, "adapter_host_hits": 0,
                  "adapter_host_misses": 0}
        for beat in beats:
            engine = beat.stats.get("engine") or {}
            load = engine.get("adapter_load") or {}
            totals["adapter_loads"] += int(load.get("count") or 0)
            for key in ("adapter_host_hits", "adapter_host_misses"):
                totals[key] += int(engine.get(key) or 0)
            totals["stolen"] += int(beat.stats.get("requests_stolen") or 0)
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=60)
        self.procs = []
        return totals

    def beats(self) -> list[protocol.EngineHeartbeat]:
        docs = protocol.live_heartbeats(self.client, time.time())
        return [b for b in (protocol.EngineHeartbeat.decode(d) for d in docs)
                if b.model == MODEL and not b.draining]


class Reader(threading.Thread):
    """Reads every open request's events: its engine, its first token's time, its usage."""

    def __init__(self, client: redis.Redis, routers: list[Router]) -> None:
        super().__init__(daemon=True)
        self.client = client
        # Each told when a request it placed starts, as the web tier's dispatch does.
        self.routers = routers
        self.placed_by: dict[str, Router] = {}
        self.sent: dict[str, Sent] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()

    def add(self, request: protocol.EngineRequest, placement: Placement,
            router: Router) -> None:
        with self.lock:
            self.sent[request.request_id] = Sent(request, placement, time.monotonic())
            self.placed_by[request.request_id] = router

    def run(self) -> None:
        last: dict[str, bytes] = {}
        while not self.done.is_set() or last:
            with self.lock:
                last.update({rid: b"0-0" for rid, s in self.sent.items()
                             if not s.usage and rid not in last})
            if not last:
                time.sleep(0.005)
                continue
            reply = self.client.xread({protocol.events_stream(MODEL, r): i
                                       for r, i in last.items()},
                                      block=20) or []
            now = time.monotonic()
            for stream, entries in reply:
                rid = stream.decode().rsplit(":", 1)[1]
                for entry_id, fields in entries:
                    last[rid] = entry_id
                    if self.take(self.sent[rid], protocol.Event.decode(fields), now):
                        del last[rid]

    def take(self, record: Sent, event: protocol.Event, now: float) -> bool:
        if event.type == protocol.EV_ACCEPTED:
            record.engine = event.data["engine_id"]
        if event.type == protocol.EV_DELTA and record.first is None:
            record.first = now - record.at
        if event.type == protocol.EV_DELTA or event.is_final:
            with self.lock:
                self.placed_by[record.request.request_id].started(record.placement,
                                                                  record.request.request_id)
        if event.is_final:
            record.usage = event.data.get("usage") or {"error": True}
        return event.is_final


def run(policy: str, fleet: Fleet, plan: list[tuple[float, dict]],
        hashes: list[str]) -> dict:
    """``policy``: random, scored, or scored+key (scored, each request naming its cached
    prefix, the tenant's system prompt under its adapter, in ``prompt_cache_key``, which
    the web tier passes to placement as the session)."""
    fleet.start()
    client = fleet.client
    # One router per web process: each knows only what it placed itself.
    routers = [Router() for _ in range(fleet.args.web_processes)]
    reader = Reader(client, routers)
    sent = reader.sent
    reader.start()
    beats, read_at = fleet.beats(), time.monotonic()
    began = time.monotonic()
    for i, (at, parts) in enumerate(plan):
        time.sleep(max(0.0, began + at - time.monotonic()))
        if time.monotonic() - read_at >= 0.5:  # as the web tier: one read per half second
            beats, read_at = fleet.beats(), time.monotonic()
        tenant = f"tenant-{parts['tenant']}"
        request = protocol.EngineRequest(
            request_id=f"{policy}-{i}", model=MODEL, prompt_token_ids=parts["prompt"],
            tenant_id=tenant, cache_salt=f"salt-{tenant}", adapter=parts["adapter"],
            adapter_hash=hashes[int(parts["adapter"].rsplit("-", 1)[1])],
            sampling=protocol.SamplingSpec(max_tokens=OUTPUT, temperature=0.0,
                                           ignore_eos=True))
        router = routers[i % len(routers)]
        with reader.lock:  # the reader thread tells the router what started
            placement = router.place(request, beats, policy=policy.split("+")[0],
                                     session=f"system-{tenant}-{parts['adapter']}"
                                     if "+key" in policy else None)
        reader.add(request, placement, router)
        client.xadd(placement.stream, request.encode())
    deadline = time.monotonic() + 120
    while any(not s.usage for s in sent.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    reader.done.set()
    reader.join(timeout=10)
    time.sleep(protocol.HEARTBEAT_INTERVAL_S + 0.5)  # the engines' last counts
    totals = fleet.stop()
    finished = [s for s in sent.values() if s.usage and "error" not in s.usage]
    per_engine: dict[str, int] = {}
    for s in finished:
        per_engine[s.engine] = per_engine.get(s.engine, 0) + 1
    # The second half too: past the first request of each tenant and adapter on each
    # engine (cold for every policy), what a fleet that has served a while sees.
    steady = finished[len(finished) // 2:]
    return {"policy": policy, "requests": len(sent), "finished": len(finished),
            **figures(finished), "adapter_loads": totals["adapter_loads"],
            # Requests that found their adapter in their engine's memory on arrival.
            "adapter_hit_rate": round(totals["adapter_host_hits"] / max(
                1, totals["adapter_host_hits"] + totals["adapter_host_misses"]), 4),
            "stolen": totals["stolen"], "per_engine": dict(sorted(per_engine.items())),
            "second_half": figures(steady)}


def figures(done: list[Sent]) -> dict[str, float]:
    ttfts = sorted(s.first for s in done if s.first is not None)
    prompt = sum(s.usage.get("prompt_tokens", 0) for s in done)
    cached = sum(s.usage.get("cached_tokens", 0) for s in done)
    return {"prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "ttft_p50_s": round(statistics.median(ttfts), 4),
            "ttft_p95_s": round(ttfts[int(0.95 * (len(ttfts) - 1))], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=6.0, help="arrivals a second")
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kv-blocks", type=int, default=1200)
    parser.add_argument("--max-cpu-loras", type=int, default=3)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    parser.add_argument("--web-processes", type=int, default=1,
                        help="routers placing the requests in turn (web processes)")
    parser.add_argument("--prompt-cache-key", action="store_true",
                        help="also run scored placement with each tenant's prompt_cache_key "
                             "(writes routing_key.json)")
    args = parser.parse_args()

    from bench.lora_throughput import make_adapters
    from engine.demo_model import build_model
    from engine.lora.store import AdapterStore
    from engine.models.model_config import ModelConfig

    tmp = Path(tempfile.mkdtemp())
    model_dir = build_model(tmp / "model", size="demo")
    store = AdapterStore(tmp / "store")
    hashes = [store.put(f) for f in make_adapters(model_dir, tmp / "peft", ADAPTERS, 8)]
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    plan = trace(args, vocab, [f"adapter-{i}" for i in range(ADAPTERS)])
    fleet = Fleet(args, model_dir, store.root)
    runs: dict[str, list[dict]] = {"scored": [], "random": []}
    if args.prompt_cache_key:
        runs["scored+key"] = []
    try:
        for round_ in range(args.rounds):
            order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
            for policy in order:
                runs[policy].append(run(policy, fleet, plan, hashes))
                print(json.dumps(runs[policy][-1]), flush=True)
    finally:
        for proc in fleet.procs:
            proc.kill()

    def median(policy: str, key: str, part: str | None = None) -> float:
        return statistics.median((r[part] if part else r)[key] for r in runs[policy])

    result = {
        "engines": ENGINES, "tenants": TENANTS, "adapters": ADAPTERS,
        "prefix_tokens": PREFIX, "suffix_tokens": SUFFIX, "output_tokens": OUTPUT,
        "rate_per_s": args.rate, "seconds": args.seconds, "rounds": args.rounds,
        "kv_blocks_per_engine": args.kv_blocks, "max_cpu_loras": args.max_cpu_loras,
        "prefix_hit_rate_routed": median("scored", "prefix_hit_rate"),
        "prefix_hit_rate_random": median("random", "prefix_hit_rate"),
        "ttft_p50_routed_s": median("scored", "ttft_p50_s"),
        "ttft_p50_random_s": median("random", "ttft_p50_s"),
        "ttft_p95_routed_s": median("scored", "ttft_p95_s"),
        "ttft_p95_random_s": median("random", "ttft_p95_s"),
        "adapter_loads_routed": median("scored", "adapter_loads"),
        "adapter_loads_random": median("random", "adapter_loads"),
        "adapter_hit_rate_routed": median("scored", "adapter_hit_rate"),
        "adapter_hit_rate_random": median("random", "adapter_hit_rate"),
        "second_half": {f"{key}_{name}": median(policy, key, "second_half")
                        for key in ("prefix_hit_rate", "ttft_p50_s", "ttft_p95_s")
                        for name, policy in (("routed", "scored"), ("random", "random"))},
        "runs": runs,
    }
    result["hit_rate_ratio"] = round(
        result["prefix_hit_rate_routed"] / max(result["prefix_hit_rate_random"], 1e-9), 2)
    result["ttft_p95_reduction"] = round(
        1 - result["ttft_p95_routed_s"] / result["ttft_p95_random_s"], 3)
    result["web_processes"] = args.web_processes
    name = "routing" if args.kv_blocks == parser.get_default("kv_blocks") else \
        f"routing_kv{args.kv_blocks}"
    if args.prompt_cache_key:
        name = "routing_key"
        result["prefix_hit_rate_key"] = median("scored+key", "prefix_hit_rate")
        result["ttft_p50_key_s"] = median("scored+key", "ttft_p50_s")
        result["adapter_hit_rate_key"] = median("scored+key", "adapter_hit_rate")
        result["second_half"]["prefix_hit_rate_key"] = median("scored+key",
                                                              "prefix_hit_rate", "second_half")
    path = write_result(name, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
