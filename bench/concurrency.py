"""Concurrent streams per web process: failures, latency the web tier adds, RSS, CPU, Redis
connections, for N open SSE streams.

One `atrium web` process on a Redis server of its own, and an engine worker whose model is
a clock (bench/paced_engine.py: every open request streams at --tokens-per-s, no batch
limit, each token stamped with when the request entered the engine and when the token was
made; --lockstep: every request's token in one step, once a tick).
For each N, N streams are opened over a short ramp and held open (each lives
max_tokens / rate seconds), so all N are open at the peak. Per N it reports:

- failures: anything but a complete stream (a non-200, an error event, a cut connection);
- ttft_overhead_ms: what a client waited for its first token beyond the engine's own
  time to it (client TTFT - (token made - request entered the engine)): the web tier and
  Redis, both ways; measured by 100 probe requests, one after another, from a process of
  their own (so the load generator's own event loop is not in the figure) once all N
  streams are open and have had their first token (burst_ttft_overhead_ms: the same for
  the N streams themselves, which arrive at --ramp-per-s and queue for admission behind
  each other; burst_admitted_ms: from sending to the response's headers);
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
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from tests.redis_server import RedisServer  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "atrium-demo"
PROBES = 100


def _cli(env: dict, home: Path, *args: str) -> str:
    done = subprocess.run([str(BIN / "atrium"), *args], env=env, cwd=home,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"atrium {' '.join(args)}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def wait_ready(base: str, web_proc: subprocess.Popen, logs: list[Path],
               timeout: float = 120) -> None:
    """Until the web process at ``base`` answers /readyz; its ``logs`` if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or web_proc.poll() is not None:
            raise SystemExit("the web process did not start:\n"
                             + "".join(log.read_text()[-3000:] for log in logs if log.exists()))
        time.sleep(0.3)


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
        return _cpu_s(self.proc.pid)

    def connections(self) -> int:
        name = f"atrium-{self.proc.pid}"
        clients = self.client.client_list()
        named = sum(1 for c in clients if c.get("name") == name)
        # The code before this change did not name its connections: count by elimination
        # (every client but this bench's and the engine's, which are few and named).
        return named or sum(1 for c in clients if not c.get("name"))


async def _body_lines(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The lines of a response body, chunked or read to the end."""
    if not chunked:
        while line := await reader.readline():
            yield line.rstrip(b"\r\n")
        return
    pending = b""
    while size := int((await reader.readline()).split(b";")[0], 16):
        pending += (await reader.readexactly(size + 2))[:-2]
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")


async def _stream(base: str, key: str, max_tokens: int, out: dict) -> None:
    """One streamed chat completion over a connection of its own.

    NOTE: HTTP by hand on asyncio streams, not httpx: with a thousand connections open,
    httpx's pool and stream machinery made the load generator, not the server, what the
    figures measured."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hold"}]}).encode()
    sent = time.time()
    tokens = 0
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\n"
                     b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (host.encode(), key.encode(), len(body), body))
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (header := (await reader.readline()).lower()) not in (b"\r\n", b""):
            chunked = chunked or (header.startswith(b"transfer-encoding:")
                                  and b"chunked" in header)
        if status != 200:
            out["failures"].append(str(status))
            return
        out["admitted"].append((time.time() - sent) * 1000)
        async for line in _body_lines(reader, chunked):
            if not line.startswith(b"data: {"):
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
    except (OSError, EOFError, ValueError, IndexError) as exc:
        out["failures"].append(type(exc).__name__)
    finally:
        if writer is not None:
            writer.close()


async def _measure(web: Web, base: str, key: str, n: int, *, max_tokens: int,
                   ramp_per_s: float, others: dict[str, int]) -> dict:
    out: dict[str, list] = {"failures": [], "delivery": [], "overhead": [], "admitted": []}
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
    others0 = {name: _cpu_s(pid) for name, pid in others.items()}
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(_stream(base, key, max_tokens, out)))
        if ramp_per_s and (i + 1) % 50 == 0:
            await asyncio.sleep(50 / ramp_per_s)
    # At the peak (every stream open and streaming, the burst's queue gone): probes one
    # after another, each a short stream of its own: the latency the web tier adds for a
    # new request while N streams are open.
    settled = time.monotonic() + 60
    while len(out["overhead"]) + len(out["failures"]) < n and time.monotonic() < settled:
        await asyncio.sleep(0.1)
    await asyncio.sleep(3)  # the burst's last requests' own work (logs, settling) done
    prober = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--probe", base, key, str(PROBES),
        stdout=asyncio.subprocess.PIPE)
    probes = json.loads((await prober.communicate())[0])
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    cpu = web.cpu_s() - cpu0
    shares = {name: round((_cpu_s(pid) - others0[name]) / wall, 2)
              for name, pid in others.items()}
    done.set()
    await sampler
    failures: dict[str, int] = {}
    for failure in out["failures"]:
        failures[failure] = failures.get(failure, 0) + 1
    return {
        "streams": n, "failures": sum(failures.values()), "failure_kinds": failures,
        "burst_ttft_overhead_ms_p50": _pct(out["overhead"], 0.5),
        "burst_ttft_overhead_ms_p99": _pct(out["overhead"], 0.99),
        "burst_admitted_ms_p50": _pct(out["admitted"], 0.5),
        "burst_admitted_ms_p99": _pct(out["admitted"], 0.99),
        "probes": len(probes["overhead"]), "probe_failures": len(probes["failures"]),
        "ttft_overhead_ms_p50": _pct(probes["overhead"], 0.5),
        "ttft_overhead_ms_p99": _pct(probes["overhead"], 0.99),
        "probe_admitted_ms_p50": _pct(probes["admitted"], 0.5),
        "probe_admitted_ms_p99": _pct(probes["admitted"], 0.99),
        "delivery_ms_p50": _pct(out["delivery"], 0.5),
        "delivery_ms_p99": _pct(out["delivery"], 0.99),
        "web_rss_mb_peak": round(peak["rss"], 1),
        "web_cpu_core_share": round(cpu / wall, 2), "wall_s": round(wall, 1),
        "other_cpu_core_share": shares,
        "redis_connections_peak": peak["connections"],
    }


async def _probe(base: str, key: str, count: int) -> dict:
    """``count`` one-token streams, one after another."""
    out: dict[str, list] = {"failures": [], "delivery": [], "overhead": [], "admitted": []}
    for _ in range(count):
        await _stream(base, key, 1, out)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--probe"]:
        base, key, count = sys.argv[2:5]
        print(json.dumps(asyncio.run(_probe(base, key, int(count)))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 300, 1000, 3000])
    parser.add_argument("--tokens-per-s", type=float, default=1.0,
                        help="the engine's pace per stream")
    parser.add_argument("--lockstep", action="store_true",
                        help="the engine makes every stream's token in one step")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--ramp-per-s", type=float, default=300.0,
                        help="streams opened per second (0: all at once)")
    parser.add_argument("--pin", action="store_true",
                        help="the web process alone on CPU 0, everything else on the others "
                             "(as when the load generator runs on another host)")
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
            stdout=(home / "web.log").open("w"), stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if args.pin else None)
        procs.append(web_proc)
        if args.pin:
            others = set(range(os.cpu_count() or 1)) - {0}
            os.sched_setaffinity(server.process.pid, others)
            os.sched_setaffinity(0, others)  # this process, and the engine and probes it starts
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "bench.paced_engine", "--redis-url", server.url,
             "--model-name", MODEL, "--tokens-per-s", str(args.tokens_per_s),
             *(["--lockstep"] if args.lockstep else [])],
            env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=(home / "engine.log").open("w")))
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, web_proc, [home / "web.log", home / "engine.log"])
        web = Web(web_proc, server.url)
        others = {"client": os.getpid(), "engine": procs[1].pid,
                  "redis": server.process.pid}
        rows = []
        for n in args.streams:
            row = asyncio.run(_measure(web, base, key, n, max_tokens=args.max_tokens,
                                       ramp_per_s=args.ramp_per_s, others=others))
            print(json.dumps(row), flush=True)
            rows.append(row)
            time.sleep(2)
        clean = [r for r in rows if r["failures"] == 0]
        top = max(clean, key=lambda r: r["streams"]) if clean else None
        result = {
            "bench": "concurrency", "web_root": str(args.web_root),
            "machine": f"{os.cpu_count()} CPUs, CPU only; client, web, engine and Redis "
                       f"on the same machine" + (", the web process alone on CPU 0"
                                                 if args.pin else ""),
            "tokens_per_s_per_stream": args.tokens_per_s, "lockstep": args.lockstep,
            "web_pinned_to_cpu0": args.pin,
            "max_tokens": args.max_tokens,
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
