"""What metrics and traces cost (issue 18's goal: at most 1%), on and off in one run.

- **Engine step**: the real worker loop (`engine.worker.Worker.tick`) with the demo model on
  the CPU, a Redis server of its own, a batch of requests run to the end. *On*: the
  engine's metrics as shipped, a scrape of its registry every second (as Prometheus
  would), traces exported over OTLP/HTTP to a sink in another process. *Off*: the
  metrics' recording replaced by no-ops, no scrape, tracing off. Reported: the worker
  process's CPU per engine step.
- **Web request path**: one `atrium web` process against the paced engine
  (bench/paced_engine.py, a token every 10 ms), short streamed chat requests from 16
  clients at once. *Off*: `--peer-root`, a checkout of the code before metrics and
  traces (the same request path otherwise). *Metrics*: this checkout, its metrics
  endpoint scraped every second, traces off. *Traced*: and every request traced
  (`OTEL_TRACES_SAMPLER=parentbased_always_on`), the spans exported to the sink.
  *Sampled*: tracing on as shipped, an OTLP endpoint and no sampler named: one new trace
  in ten kept (engine/tracing.py).
  Reported: the web process's CPU per request and the TTFT it adds (p50).

Rounds alternate on and off; the figure is the median round. On this 2-CPU VM the web
rounds' CPU per request spreads by about ±10% from round to round, ten times the goal, so
the web figures are also **attributed**: a process of its own, set up as `atrium web` is
(multiprocess metrics, OTLP to the sink), makes the calls the request path makes to
metrics and traces for one streamed chat request (inference/telemetry.py, core/metrics.py)
20,000 times and reports their CPU per request (the span exporter's thread included);
each metrics round ends with 100 scrapes of the idle web process, whose CPU is one
scrape's cost. Divided by the off rounds' CPU per request (and, for scrapes, by the
rounds' request rate and the scrape interval), these give overhead figures to a tenth of
a percent. Writes bench/results/observability.json.

    .venv/bin/python bench/observability.py --peer-root /tmp/peer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]
from bench.concurrency import MODEL, _cli, _cpu_s, _pct, _stream, wait_ready  # noqa: E402
from tests.ports import free_port as _free_port  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

BIN = Path(sys.executable).parent


# --- an OTLP sink in a process of its own --------------------------------------------------

class _Sink(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the http.server interface
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _sink_main(port: int) -> None:
    ThreadingHTTPServer(("127.0.0.1", port), _Sink).serve_forever()


# --- engine step ---------------------------------------------------------------------------

def _engine_round(on: bool, redis_url: str, model_dir: Path, sink: str, requests: int,
                  max_tokens: int) -> dict:
    """One round in a fresh process (so the off round's no-ops and the on round's tracer
    never meet); its CPU per step."""
    done = subprocess.run(
        [sys.executable, __file__, "--engine-round", json.dumps(
            {"on": on, "redis_url": redis_url, "model_dir": str(model_dir), "sink": sink,
             "requests": requests, "max_tokens": max_tokens})],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'platform'}"})
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(lines[-1])


def _engine_round_main(spec: dict) -> None:
    import torch

    from engine import protocol, tracing
    from engine.metrics import EngineMetrics, Histogram, engine_registry
    from engine.worker import Worker, WorkerConfig, default_engine_factory

    torch.set_num_threads(1)  # one thread: CPU per step varies less between rounds
    provider = None
    if spec["on"]:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # What configure_from_env builds, kept at hand to flush it before the figure.
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=spec["sink"] + "/v1/traces")))
        tracing.use_provider(provider)
    else:
        EngineMetrics.record_step = lambda self, **kw: None
        EngineMetrics.record_finish = lambda self, reason, **kw: None
        Histogram.observe = lambda self, value: None
    client = redis.Redis.from_url(spec["redis_url"])
    client.flushdb()
    engine = default_engine_factory(Path(spec["model_dir"]))
    worker = Worker(client, engine, model_name=MODEL, engine_id="bench",
                    config=WorkerConfig())
    worker.ensure_group()
    stop = threading.Event()
    if spec["on"]:
        registry = engine_registry(lambda: worker.last_snapshot, model_name=MODEL,
                                   engine="bench")

        def scrape() -> None:
            from prometheus_client import generate_latest

            while not stop.wait(1.0):
                generate_latest(registry)

        threading.Thread(target=scrape, daemon=True).start()
    parent = "00-" + secrets.token_hex(16) + "-" + secrets.token_hex(8) + "-01"
    for i in range(spec["requests"]):
        request = protocol.EngineRequest(
            request_id=f"r{i}", model=MODEL, prompt_token_ids=[5 + i % 50, 6, 7, 8] * 8,
            sampling=protocol.SamplingSpec(max_tokens=spec["max_tokens"], ignore_eos=True),
            tenant_id=str(i % 4), cache_salt="bench",
            traceparent=parent if spec["on"] else None)
        client.xadd(protocol.request_stream(MODEL), request.encode())
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while worker.events.finished < spec["requests"]:
        worker.tick()
    if provider is not None:
        provider.force_flush()  # the spans' export counts too
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    stop.set()
    print(json.dumps({"steps": worker.steps, "cpu_ms_per_step": cpu * 1000 / worker.steps,
                      "wall_ms_per_step": wall * 1000 / worker.steps}), flush=True)
    os._exit(0)  # NOTE: not the interpreter's exit: a native thread aborts it at times


# --- web request path ----------------------------------------------------------------------

async def _clients(base: str, key: str, count: int, concurrency: int) -> dict:
    out: dict[str, list] = {"failures": [], "delivery": [], "overhead": [], "admitted": []}
    remaining = iter(range(count))

    async def client() -> None:
        for _ in remaining:
            await _stream(base, key, 2, out)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


# The web modes: off (the peer checkout), metrics (scraped, no traces), traced (every
# request), sampled (tracing as shipped: one new trace in ten).
WEB_MODES = ("off", "metrics", "traced", "sampled")


def _web_round(mode: str, root: Path, env: dict, home: Path, key: str, sink: str,
               requests: int, scrape_every: float) -> dict:
    on = mode != "off"
    port, metrics_port = _free_port(), _free_port()
    web_env = {**env, "PYTHONPATH": f"{root}:{root / 'platform'}"}
    args = ["web", "--port", str(port)]
    if on:
        args += ["--metrics-port", str(metrics_port)]
    if mode in ("traced", "sampled"):
        web_env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink
    if mode == "traced":
        web_env["OTEL_TRACES_SAMPLER"] = "parentbased_always_on"
    proc = subprocess.Popen([sys.executable, "-c", "from atrium.cli import main; main()", *args],
                            env=web_env, cwd=root, stdout=(home / "web.log").open("a"),
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    try:
        wait_ready(base, proc, [home / "web.log"])
        asyncio.run(_clients(base, key, 200, 16))  # warm: key cache, imports, pools
        if on:
            def scrape() -> None:  # one at the start, then every scrape_every seconds
                while True:
                    httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
                    if stop.wait(scrape_every):
                        return

            threading.Thread(target=scrape, daemon=True).start()
        cpu0, wall0 = _cpu_s(proc.pid), time.monotonic()
        out = asyncio.run(_clients(base, key, requests, 16))
        cpu, wall = _cpu_s(proc.pid) - cpu0, time.monotonic() - wall0
        stop.set()
        scrape_ms = _scrape_cpu_ms(proc.pid, metrics_port) if on else None
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=30)
    return {"requests": requests, "failures": len(out["failures"]),
            "cpu_ms_per_request": cpu * 1000 / requests, "requests_per_s": requests / wall,
            "scrape_cpu_ms": scrape_ms, "ttft_overhead_ms_p50": _pct(out["overhead"], 0.5)}


# --- the web tier's instrumentation, attributed ----------------------------------------------

ATTRIBUTED_CALLS = 20_000


def _attribution_main(mode: str, sink: str) -> None:
    """Prints the CPU microseconds one request's metrics (and, traced, its span) cost in a
    process configured as `atrium web` is."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="atrium-prom-")
    if mode != "metrics":
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink
    if mode == "traced":
        os.environ["OTEL_TRACES_SAMPLER"] = "parentbased_always_on"
    from types import SimpleNamespace

    from core import metrics
    from engine import tracing
    from inference import telemetry

    assert tracing.configure_from_env("web") == (mode != "metrics")
    usage = {"prompt_tokens": 14, "completion_tokens": 2}

    def one_request() -> None:
        # What a streamed chat request does to metrics and traces, in its order.
        began = time.perf_counter()
        trace = SimpleNamespace(
            kind="chat", transport="http", status=200, principal=SimpleNamespace(
                tenant_slug="bench"), prepared=SimpleNamespace(model=SimpleNamespace(
                    name=MODEL)), dispatch=SimpleNamespace(counted_usage=lambda: usage),
            span=telemetry.request_span({}, "POST /v1/chat/completions"))
        metrics.AUTH_SECONDS.observe(time.perf_counter() - began)
        telemetry.phase(trace.span, "auth", began)
        metrics.ADMISSION_SECONDS.observe(time.perf_counter() - began)
        telemetry.phase(trace.span, "admission", began)
        telemetry.traceparent(trace.span)
        streams = metrics.OPEN_STREAMS.labels("sse")
        streams.inc()
        streams.dec()
        metrics.HTTP_REQUESTS.labels("v1/chat/completions", "POST", "200").inc()
        telemetry.request_ended(trace)

    flush = tracing.flush
    for _ in range(1000):  # warm: label children, files, the exporter's session
        one_request()
    flush()
    cpu0 = time.process_time()
    for i in range(ATTRIBUTED_CALLS):
        one_request()
        if i % 500 == 499:
            flush()  # exported as it goes: no span dropped from a full queue
    flush()
    per_request_us = (time.process_time() - cpu0) / ATTRIBUTED_CALLS * 1e6
    print(json.dumps({"us_per_request": round(per_request_us, 2)}), flush=True)


def _attribution(mode: str, sink: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROMETHEUS_"))}
    env["DJANGO_SETTINGS_MODULE"] = "atrium.settings"
    out = subprocess.run([sys.executable, __file__, "--attribution", mode, sink], env=env,
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _scrape_cpu_ms(pid: int, metrics_port: int, scrapes: int = 100) -> float:
    """The web process's CPU for one scrape of its endpoint (the fleet collector's Redis and
    database reads included), measured with no request in flight."""
    time.sleep(0.5)
    cpu0 = _cpu_s(pid)
    with httpx.Client(timeout=5) as client:
        for _ in range(scrapes):
            client.get(f"http://127.0.0.1:{metrics_port}/metrics").raise_for_status()
    return (_cpu_s(pid) - cpu0) * 1000 / scrapes


def _median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 4)


def main() -> None:
    if sys.argv[1:2] == ["--engine-round"]:
        _engine_round_main(json.loads(sys.argv[2]))
        return
    if sys.argv[1:2] == ["--attribution"]:
        _attribution_main(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1:2] == ["--sink"]:
        _sink_main(int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-root", type=Path, required=True,
                        help="a checkout of the code before metrics and traces")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--engine-requests", type=int, default=32)
    parser.add_argument("--engine-max-tokens", type=int, default=128)
    parser.add_argument("--web-requests", type=int, default=1500)
    parser.add_argument("--scrape-every", type=float, default=1.0,
                        help="seconds between scrapes of the web process's metrics")
    parser.add_argument("--skip-engine", action="store_true",
                        help="measure the web request path only")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/observability.json")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="atrium-observability-"))
    server = RedisServer(home, persistent=False)
    server.start()
    sink_port = _free_port()
    sink_proc = subprocess.Popen([sys.executable, __file__, "--sink", str(sink_port)])
    sink = f"http://127.0.0.1:{sink_port}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATRIUM_", "DJANGO_", "OTEL_")) and k != "DATABASE_URL"}
    env.update(ATRIUM_HOME=str(home), REDIS_URL=server.url,
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    procs: list[subprocess.Popen] = [sink_proc]
    try:
        model_dir = Path(_cli(env, home, "build-demo-model").splitlines()[-1])
        engine_rows: dict[str, list] = {"on": [], "off": []}
        for _ in range(0 if args.skip_engine else args.rounds):
            for mode in ("off", "on"):
                row = _engine_round(mode == "on", server.url, model_dir, sink,
                                    args.engine_requests, args.engine_max_tokens)
                engine_rows[mode].append(row)
                print("engine", mode, json.dumps(row), flush=True)

        _cli(env, home, "migrate", "--verbosity", "0")
        _cli(env, home, "create-tenant", "Bench", "--slug", "bench")
        _cli(env, home, "set-limits", "bench", "--max-concurrent-requests", "100000",
             "--requests-per-minute", "1000000", "--tokens-per-minute", "100000000")
        key = _cli(env, home, "create-key", "bench").split()[-1]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "bench.paced_engine", "--redis-url", server.url,
             "--model-name", MODEL, "--tokens-per-s", "100"],
            env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=(home / "engine.log").open("w")))
        web_rows: dict[str, list] = {mode: [] for mode in WEB_MODES}
        for _ in range(args.rounds):
            for mode in WEB_MODES:
                root = args.peer_root if mode == "off" else ROOT
                row = _web_round(mode, root, env, home, key, sink, args.web_requests,
                                 args.scrape_every)
                web_rows[mode].append(row)
                print("web", mode, json.dumps(row), flush=True)
        attributed = {mode: _attribution(mode, sink) for mode in WEB_MODES[1:]}
    finally:
        for proc in procs:
            proc.terminate()
        server.kill()

    web = {mode: _median(web_rows[mode], "cpu_ms_per_request") for mode in WEB_MODES}
    rate = _median(web_rows["off"], "requests_per_s")
    scrape_ms = _median(web_rows["metrics"], "scrape_cpu_ms")
    scrape_per_request_ms = scrape_ms / (args.scrape_every * rate)
    result: dict = {
        "bench": "observability",
        "machine": f"{os.cpu_count()} CPUs, CPU only; engine, web, Redis, sink and clients "
                   "on the same machine",
        "rounds": args.rounds, "peer_root": str(args.peer_root),
        "engine": None,
        "web": {"requests": args.web_requests, "concurrency": 16,
                "scrape_every_s": args.scrape_every,
                **{f"cpu_ms_per_request_{mode}": web[mode] for mode in WEB_MODES},
                **{f"overhead_pct_{mode}": round((web[mode] / web["off"] - 1) * 100, 2)
                   for mode in WEB_MODES[1:]},
                **{f"ttft_overhead_ms_p50_{mode}": _median(web_rows[mode],
                                                           "ttft_overhead_ms_p50")
                   for mode in WEB_MODES},
                "requests_per_s_off": rate,
                "attributed": {
                    "calls": ATTRIBUTED_CALLS, "scrape_ms": scrape_ms,
                    "scrape_pct_at_1s": round(scrape_ms / rate / web["off"] * 100, 3),
                    **{f"us_per_request_{mode}": attributed[mode]["us_per_request"]
                       for mode in WEB_MODES[1:]},
                    **{f"overhead_pct_{mode}": round(
                        (attributed[mode]["us_per_request"] / 1000 + scrape_per_request_ms)
                        / web["off"] * 100, 2) for mode in WEB_MODES[1:]}},
                "rounds": web_rows},
    }
    if not args.skip_engine:
        on, off = (_median(engine_rows[m], "cpu_ms_per_step") for m in ("on", "off"))
        result["engine"] = {"requests": args.engine_requests,
                            "max_tokens": args.engine_max_tokens, "cpu_ms_per_step_on": on,
                            "cpu_ms_per_step_off": off,
                            "overhead_pct": round((on / off - 1) * 100, 2),
                            "rounds": engine_rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("engine", "web")}
                     | {"engine_overhead_pct": (result["engine"] or {}).get("overhead_pct")}
                     | {k: v for k, v in result["web"].items() if k.startswith("overhead")}
                     | {f"attributed_{k}": v for k, v in result["web"]["attributed"].items()
                        if k.startswith("overhead")},
                     indent=2))


if __name__ == "__main__":
    main()
