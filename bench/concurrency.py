"""Concurrent streams per web process: failures, latency the web tier adds, RSS, CPU, Redis
connections, for N open SSE streams.

One `atrium web` process on a Redis server of its own, and an engine worker whose model is
a clock (bench/paced_engine.py: every open request gets one token per tick, no batch limit,
each token stamped with when the request entered the engine and when the token was made).
For each N, N streams are opened over a short ramp and held open (each lives
max_tokens / rate seconds), so all N are open at the peak. Per N it reports:

- failures: anything but a complete stream (a non-200, an error event, a cut connection);
- ttft_overhead_ms: what a client waited for its first token beyond the engine's own
  time to it (client TTFT - (token made - request entered the engine)): the web tier and
  Redis, both ways; measured by 20 probe requests, one after another, while all N streams
  are open (burst_ttft_overhead_ms: the same for the N streams themselves, which arrive
  at --ramp-per-s and queue for admission behind each other);
- delivery_ms: token made -> token read by the client, over every token;
- the web process's peak RSS and CPU (of one core) and its Redis connections (the
  process names its connections by pid; the most seen).

`--web-root` runs another checkout's web process against the same setup (the peer: the
code before this change, which held one Redis connection per open stream). Writes
bench/results/concurrency.json (or --out).

    .venv/bin/python bench/concurrency.py --streams 100 300 1000 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from tests.redis_server import RedisServer  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "atrium-demo"
PROBES = 20


def _cli(env: dict, home: Path, *args: str) -> str:
    done = subprocess.run([str(BIN / "atrium"), *args], env=env, cwd=home,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"atrium {' '.join(args)}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


class Web:
    """The web process, its memory, CPU and Redis connections."""

    def __init__(self, proc: subprocess.Popen, redis_url: str) -> None:
        self.proc = proc
        self.client = redis.Redis.from_url(redis_url)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def connections(self) -> int:
        name = f"atrium-{self.proc.pid}"
        clients = self.client.client_list()
        named = sum(1 for c in clients if c.get("name") == name)
        # The code before this change did not name its connections: count by elimination
        # (every client but this bench's and the engine's, which are few and named).
        return named or sum(1 for c in clients if not c.get("name"))


async def _stream(http: httpx.AsyncClient, key: str, max_tokens: int, out: dict) -> None:
    sent = time.time()
    tokens = 0
    try:
        async with http.stream("POST", "/v1/chat/completions", headers={
                "Authorization": f"Bearer {key}"}, json={
                "model": MODEL, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "hold"}]}) as response:
            if response.status_code != 200:
                out["failures"].append(str(response.status_code))
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.time()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["failures"].append(chunk["error"].get("code") or "error")
                    return
                content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] \
                    else None
                if not content:
                    continue
                entered, made = (float(x) for x in content.split("/"))
                out["delivery"].append((now - made) * 1000)
                if tokens == 0:
                    out["overhead"].append(((now - sent) - (made - entered)) * 1000)
                tokens += 1
        if tokens != max_tokens:
            out["failures"].append(f"short:{tokens}")
    except httpx.HTTPError as exc:
        out["failures"].append(type(exc).__name__)


async def _measure(web: Web, base: str, key: str, n: int, *, max_tokens: int,
                   ramp_per_s: float) -> dict:
    out: dict[str, list] = {"failures": [], "delivery": [], "overhead": []}
    http = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=60),
                             limits=httpx.Limits(max_connections=n + 10,
                                                 max_keepalive_connections=0))
    peak = {"rss": web.rss_mb(), "connections": 0}
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            peak["rss"] = max(peak["rss"], web.rss_mb())
            peak["connections"] = max(peak["connections"],
                                      await asyncio.to_thread(web.connections))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    cpu0, t0 = web.cpu_s(), time.monotonic()
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(_stream(http, key, max_tokens, out)))
        if ramp_per_s and (i + 1) % 50 == 0:
            await asyncio.sleep(50 / ramp_per_s)
    # At the peak (every stream open, the ramp over): probes one after another, each a
    # short stream of its own: the latency the web tier adds with N streams open.
    await asyncio.sleep(2)
    probes: dict[str, list] = {"failures": [], "delivery": [], "overhead": []}
    for _ in range(PROBES):
        if all(t.done() for t in tasks):
            break
        await _stream(http, key, 1, probes)
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    cpu = web.cpu_s() - cpu0
    done.set()
    await sampler
    await http.aclose()
    failures: dict[str, int] = {}
    for failure in out["failures"]:
        failures[failure] = failures.get(failure, 0) + 1
    return {
        "streams": n, "failures": sum(failures.values()), "failure_kinds": failures,
        "burst_ttft_overhead_ms_p50": _pct(out["overhead"], 0.5),
        "burst_ttft_overhead_ms_p99": _pct(out["overhead"], 0.99),
        "probes": len(probes["overhead"]), "probe_failures": len(probes["failures"]),
        "ttft_overhead_ms_p50": _pct(probes["overhead"], 0.5),
        "ttft_overhead_ms_p99": _pct(probes["overhead"], 0.99),
        "delivery_ms_p50": _pct(out["delivery"], 0.5),
        "delivery_ms_p99": _pct(out["delivery"], 0.99),
        "web_rss_mb_peak": round(peak["rss"], 1),
        "web_cpu_core_share": round(cpu / wall, 2), "wall_s": round(wall, 1),
        "redis_connections_peak": peak["connections"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 300, 1000, 3000])
    parser.add_argument("--tokens-per-s", type=float, default=1.0,
                        help="the engine's pace per stream")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--ramp-per-s", type=float, default=300.0,
                        help="streams opened per second (0: all at once)")
    parser.add_argument("--web-root", type=Path, default=ROOT,
                        help="the checkout whose web process is measured")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/concurrency.json")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="atrium-concurrency-"))
    server = RedisServer(home, persistent=False)
    server.start()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATRIUM_", "DJANGO_")) and k not in ("DATABASE_URL",)}
    env.update(ATRIUM_HOME=str(home), REDIS_URL=server.url,
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    models = ROOT / "var/e2e-models/models"
    if models.is_dir():
        shutil.copytree(models, home / "models")
    procs: list[subprocess.Popen] = []
    try:
        _cli(env, home, "build-demo-model")
        _cli(env, home, "migrate", "--verbosity", "0")
        _cli(env, home, "create-tenant", "Bench", "--slug", "bench")
        _cli(env, home, "set-limits", "bench", "--max-concurrent-requests", "100000",
             "--requests-per-minute", "1000000", "--tokens-per-minute", "100000000")
        key = _cli(env, home, "create-key", "bench").split()[-1]
        port = 18000 + os.getpid() % 1000
        web_env = {**env, "PYTHONPATH": f"{args.web_root}:{args.web_root / 'platform'}",
                   "ATRIUM_MAX_OPEN_REQUESTS": "100000"}
        web_proc = subprocess.Popen(
            [sys.executable, "-c", "from atrium.cli import main; main()", "web", "--port",
             str(port)], env=web_env, cwd=args.web_root,
            stdout=(home / "web.log").open("w"), stderr=subprocess.STDOUT)
        procs.append(web_proc)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "bench.paced_engine", "--redis-url", server.url,
             "--model-name", MODEL, "--tokens-per-s", str(args.tokens_per_s)],
            env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=(home / "engine.log").open("w")))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or web_proc.poll() is not None:
                raise SystemExit("the web process did not start:\n"
                                 + (home / "web.log").read_text()[-3000:]
                                 + (home / "engine.log").read_text()[-3000:])
            time.sleep(0.5)
        web = Web(web_proc, server.url)
        rows = []
        for n in args.streams:
            row = asyncio.run(_measure(web, base, key, n, max_tokens=args.max_tokens,
                                       ramp_per_s=args.ramp_per_s))
            print(json.dumps(row), flush=True)
            rows.append(row)
            time.sleep(2)
        clean = [r for r in rows if r["failures"] == 0]
        top = max(clean, key=lambda r: r["streams"]) if clean else None
        result = {
            "bench": "concurrency", "web_root": str(args.web_root),
            "machine": f"{os.cpu_count()} CPUs, CPU only; client, web, engine and Redis "
                       f"on the same machine",
            "tokens_per_s_per_stream": args.tokens_per_s, "max_tokens": args.max_tokens,
            "ramp_per_s": args.ramp_per_s, "rows": rows,
            "max_streams_without_failure": top["streams"] if top else 0,
            "web_rss_mb_at_max": top["web_rss_mb_peak"] if top else None,
            "redis_connections_at_max": top["redis_connections_peak"] if top else None,
            "ttft_overhead_ms_p99_at_1000": next(
                (r["ttft_overhead_ms_p99"] for r in rows if r["streams"] == 1000), None),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.process.kill()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
