"""Atrium against what a user would run instead: `transformers serve --continuous-batching`,
end to end over HTTP, with where Atrium's time goes.

Both serve the same checkpoint, which the script builds deterministically with random weights
(so every answer runs to max_tokens on both sides) and the demo model's tokenizer: one of
the demo model's shape (3.1M parameters), one 1024 wide with 8 layers (97M). For each
checkpoint and concurrency, rounds interleave the two servers (A then B, B then A, ...);
each round sends the same greedy streamed chats (`--tokens` output tokens) from
`concurrency` clients at once, and reports tokens/s (completion tokens over the round's
wall time), TTFT p50 and inter-token p50 (each request's time from its first to its last
token over its tokens after the first), and checks that both sides answered each prompt
with the same text.

Atrium runs under the real `atrium up` (embedded Redis and SQLite); the peer is
`transformers serve` from the `bench` extra (`pip install -e '.[bench]'`) on the CPU.
Then, on Atrium alone, the breakdown (docs/benchmarks.md#faster-than-transformers-serve):

- TTFT: each traced request's time from the client's first byte to its first token, cut
  at what the product's own OpenTelemetry spans say (an OTLP receiver in this script; only
  these requests carry a sampled `traceparent`): the HTTP server and middleware before the
  request's span, authentication, admission (precheck, tokenizing, admission, dispatch),
  the hop to the engine (XADD to the engine's read), the wait for the first step, the
  first step (prefill and sampling), and the way back (the event write, the web's read and
  SSE framing);
- the decode step: the engine's `atrium_engine_step_phase_seconds_total` per step, read off
  its metrics endpoint around the timed rounds.

The memory-bandwidth floor of a decode step is the weights' bytes over this machine's read
bandwidth (a large tensor summed, best of five).

    .venv/bin/python bench/e2e_peer.py [--sizes demo 97m] [--concurrency 1 32] [--rounds 3]

Writes bench/results/e2e_peer.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from bench.workload import write_result  # noqa: E402
from engine.demo_spec import ModelSpec  # noqa: E402
from tests.e2e.conftest import Atrium, free_port, user_env  # noqa: E402

BIN = Path(sys.executable).parent
SPECS = {
    # The demo model's shape, untrained.
    "demo": ModelSpec(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=512),
    # 97M parameters: 1024 wide, 8 layers.
    "97m": ModelSpec(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=8, intermediate_size=2816),
}
TOPICS = ("the harbour at dawn", "a recipe for bread", "how tides work", "a short poem",
          "the history of maps", "why the sky is blue", "a train timetable", "owls",
          "learning the violin", "a walk in the rain", "the moon's phases", "chess openings")
TTFT_STAGES = ("http_in", "auth", "admission", "to_engine", "engine_queue", "first_step",
               "back_to_client")


def checkpoint(work: Path, size: str) -> Path:
    """The ``size`` checkpoint, built once (seed 0, random weights) under ``work``."""
    from engine.demo_model import build_model

    out = work / f"random-{size}"
    if not (out / "model.safetensors").exists():
        build_model(out, spec=SPECS[size], seed=0)
    return out


def prompts(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}, "
                                         f"part {i // len(TOPICS) + 1}."}]
            for i in range(count)]


def read_bandwidth_gbs() -> float:
    """This machine's memory read bandwidth: a 512 MiB tensor summed, best of five."""
    import torch

    data = torch.ones(128 * 2**20, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - began)
    return data.numel() * 4 / best / 1e9


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- the servers ------------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    base: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    metrics_url: str = ""  # the engine's, Atrium's only


@contextlib.contextmanager
def atrium(model_dir: Path, otlp_port: int, root: Path) -> Iterator[Server]:
    home = Path(tempfile.mkdtemp(prefix="atrium-e2e-peer-"))
    env = user_env(home, ATRIUM_MODEL=str(model_dir), ATRIUM_MODEL_NAME=model_dir.name,
                   OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{otlp_port}/v1/traces",
                   # Only the breakdown's requests, which send a sampled traceparent.
                   OTEL_TRACES_SAMPLER="parentbased_always_off", OTEL_BSP_SCHEDULE_DELAY="200")
    env["PATH"] = f"{root / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"
    import tests.e2e.conftest as e2e

    e2e.BIN = root / ".venv" / "bin"
    up = Atrium(setup="embedded", home=home, env=env, port=free_port())
    up.model = model_dir.name
    up.start()
    try:
        done = up.cli("set-limits", "demo", "--requests-per-minute", "1000000",
                      "--tokens-per-minute", "1000000000", "--max-concurrent-requests", "10000")
        assert done.returncode == 0, done.stderr
        # atrium up: the web's metrics on --metrics-port, the engine's on the next
        yield Server("atrium", up.base, up.model, {"Authorization": f"Bearer {up.key}"},
                     metrics_url=f"http://127.0.0.1:{up.metrics_port + 1}/metrics")
    finally:
        up.stop()


@contextlib.contextmanager
def peer(model_dir: Path) -> Iterator[Server]:
    port = free_port()
    log = open(model_dir.parent / f"peer-{model_dir.name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(BIN / "transformers"), "serve", "--continuous-batching", "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(port), str(model_dir)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=model_dir.parent)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (model_dir.parent / f"peer-{model_dir.name}.log"
                                         ).read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "transformers serve did not start"
            time.sleep(0.5)
        yield Server("transformers serve", base, str(model_dir))
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have died on its own
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


# --- the load --------------------------------------------------------------------------------

@dataclass
class Answer:
    prompt: int
    sent: float  # time.time()
    first: float | None = None
    last: float | None = None
    text: str = ""
    error: str | None = None
    trace_id: str = ""  # the breakdown's requests: the trace their spans are in


async def _one(client: httpx.AsyncClient, server: Server, messages: list[dict[str, str]],
               index: int, tokens: int, traceparent: str | None) -> Answer:
    body = {"model": server.model, "messages": messages, "max_tokens": tokens, "stream": True,
            "temperature": 0}
    headers = dict(server.headers)
    if traceparent:
        headers["traceparent"] = traceparent
    answer = Answer(index, time.time(), trace_id=traceparent.split("-")[1] if traceparent else "")
    try:
        async with client.stream("POST", f"{server.base}/v1/chat/completions", json=body,
                                  headers=headers) as reply:
            if reply.status_code != 200:
                answer.error = f"{reply.status_code} {(await reply.aread())[:300]!r}"
                return answer
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.time()
                        answer.first = answer.first or now
                        answer.last = now
                        answer.text += piece
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    return answer


async def _load(server: Server, chats: list[list[dict[str, str]]], concurrency: int,
                tokens: int, traced: bool = False) -> tuple[list[Answer], float]:
    queue = list(enumerate(chats))
    answers: list[Answer] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            index, messages = queue.pop(0)
            parent = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01" if traced else None
            answers.append(await _one(client, server, messages, index, tokens, parent))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        began = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - began
    return answers, wall


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(answers: list[Answer], wall: float, count_tokens) -> dict[str, Any]:
    good = [a for a in answers if a.error is None and a.first is not None]
    tokens = [count_tokens(a.text) for a in good]
    itl = [(a.last - a.first) / (n - 1) * 1000 for a, n in zip(good, tokens, strict=True)
           if n > 1]
    return {"requests": len(answers), "failures": len(answers) - len(good),
            "errors": sorted({a.error for a in answers if a.error})[:3],
            "completion_tokens": sum(tokens), "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(tokens) / wall, 1),
            "ttft_p50_ms": round(_pct([(a.first - a.sent) * 1000 for a in good], 0.5), 1),
            "ttft_p90_ms": round(_pct([(a.first - a.sent) * 1000 for a in good], 0.9), 1),
            "itl_p50_ms": round(_pct(itl, 0.5), 2)}


# --- the breakdown ---------------------------------------------------------------------------

class Spans:
    """An OTLP/HTTP trace receiver on loopback: the spans Atrium exports, by trace id."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.by_trace: dict[str, list[dict[str, Any]]] = {}
        lock = threading.Lock()
        spans = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server interface
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                with lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            for span in scope.spans:
                                spans.by_trace.setdefault(span.trace_id.hex(), []).append({
                                    "name": span.name, "start": span.start_time_unix_nano / 1e9,
                                    "end": span.end_time_unix_nano / 1e9,
                                    "attributes": {a.key: _value(a.value)
                                                   for a in span.attributes}})
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def ttft_stages(answer: Answer, spans: list[dict[str, Any]]) -> dict[str, float] | None:
    """One traced request's TTFT, cut at its spans (ms); None while its spans are missing."""
    web = next((s for s in spans if s["name"].startswith("POST ")), None)
    engine = next((s for s in spans if s["name"] == "engine.request"), None)
    queue = next((s for s in spans if s["name"] == "engine.queue"), None)
    prefill = next((s for s in spans if s["name"] == "engine.prefill"), None)
    if not (web and engine and queue and prefill and answer.first):
        return None
    auth = float(web["attributes"].get("atrium.auth_ms", 0.0)) / 1000
    admission = float(web["attributes"].get("atrium.admission_ms", 0.0)) / 1000
    dispatched = web["start"] + auth + admission
    stages = {"http_in": web["start"] - answer.sent, "auth": auth, "admission": admission,
              "to_engine": engine["start"] - dispatched,
              "engine_queue": queue["end"] - queue["start"],
              "first_step": prefill["end"] - prefill["start"],
              "back_to_client": answer.first - prefill["end"]}
    return {k: v * 1000 for k, v in stages.items()}


def engine_phases(metrics_url: str) -> tuple[dict[str, float], float]:
    """(seconds per step phase, steps) off the engine's metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    phases, steps = {}, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "atrium_engine_step_phase_seconds_total":
                phases[sample.labels["phase"]] = sample.value
            elif sample.name == "atrium_engine_steps_total":
                steps = sample.value
    return phases, steps


def breakdown(server: Server, spans: Spans, metrics_url: str, chats: list, concurrency: int,
              tokens: int, count_tokens) -> dict[str, Any]:
    time.sleep(1.5)  # a heartbeat after the last request: the snapshot is current
    phases_before, steps_before = engine_phases(metrics_url)
    answers, wall = asyncio.run(_load(server, chats, concurrency, tokens, traced=True))
    time.sleep(1.5)
    phases_after, steps_after = engine_phases(metrics_url)
    steps = max(1.0, steps_after - steps_before)
    per_step = {k: round((phases_after.get(k, 0.0) - phases_before.get(k, 0.0)) / steps * 1000, 3)
                for k in phases_after}
    deadline = time.monotonic() + 10
    rows = []
    while time.monotonic() < deadline:
        rows = []
        for answer in answers:
            cut = ttft_stages(answer, spans.by_trace.get(answer.trace_id, []))
            if cut is not None:
                rows.append(cut)
        if len(rows) == len(answers):
            break
        time.sleep(0.5)
    stages = {k: round(statistics.median(r[k] for r in rows), 2) for k in TTFT_STAGES} \
        if rows else {}
    ttft = [(a.first - a.sent) * 1000 for a in answers if a.first]
    return {"concurrency": concurrency, "traced_requests": len(rows),
            "ttft_p50_ms": round(_pct(ttft, 0.5), 2), "ttft_stages_p50_ms": stages,
            "platform_share_of_ttft_p50_ms": round(statistics.median(
                sum(v for k, v in r.items() if k != "first_step") for r in rows), 2)
            if rows else None,
            "steps": int(steps), "decode_step_ms": per_step,
            "decode_step_total_ms": round(sum(per_step.values()), 3),
            "summary": summarize(answers, wall, count_tokens)}


# --- the run ---------------------------------------------------------------------------------

def compare(size: str, work: Path, concurrency: list[int], rounds: int, tokens: int,
            root: Path, spans: Spans) -> dict[str, Any]:
    from tokenizers import Tokenizer

    model_dir = checkpoint(work, size)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    params = sum(_numel(s) for s in _shapes(model_dir))
    floor_ms = params * 4 / (read_bandwidth_gbs() * 1e9) * 1000
    result: dict[str, Any] = {"checkpoint": model_dir.name, "parameters": params,
                              "bandwidth_floor_itl_ms": round(floor_ms, 2), "rows": []}
    with atrium(model_dir, spans.port, root) as ours, peer(model_dir) as theirs:
        for server in (ours, theirs):  # first requests load and compile: not measured
            asyncio.run(_load(server, prompts(4), 2, tokens))
        for c in concurrency:
            chats = prompts(max(8, 2 * c))
            runs: dict[str, list[dict[str, Any]]] = {"atrium": [], "peer": []}
            texts: dict[str, dict[int, str]] = {"atrium": {}, "peer": {}}
            for r in range(rounds):
                order = [("atrium", ours), ("peer", theirs)]
                for side, server in order if r % 2 == 0 else order[::-1]:
                    answers, wall = asyncio.run(_load(server, chats, c, tokens))
                    runs[side].append(summarize(answers, wall, count_tokens))
                    texts[side].update((a.prompt, a.text) for a in answers if a.error is None)
                    print(f"{size} c={c} round {r} {side}: {runs[side][-1]}", flush=True)
            same = sum(texts["atrium"].get(i) == texts["peer"].get(i) for i in range(len(chats)))
            row = {"concurrency": c, "requests_per_round": len(chats),
                   "identical_outputs": f"{same}/{len(chats)}"}
            for side in ("atrium", "peer"):
                row[side] = {k: statistics.median(run[k] for run in runs[side])
                             for k in ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms")}
                row[side]["failures"] = sum(run["failures"] for run in runs[side])
                row[side]["tokens_per_s_runs"] = [run["tokens_per_s"] for run in runs[side]]
            row["throughput_ratio"] = round(row["atrium"]["tokens_per_s"]
                                            / row["peer"]["tokens_per_s"], 2)
            row["itl_vs_floor"] = round(row["atrium"]["itl_p50_ms"] / floor_ms, 2)
            result["rows"].append(row)
        result["breakdown"] = [
            breakdown(ours, spans, ours.metrics_url, prompts(max(16, 2 * c)), c, tokens,
                      count_tokens) for c in concurrency]
    return result


def _shapes(model_dir: Path) -> list[list[int]]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return [list(f.get_slice(k).get_shape()) for k in f.keys()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "atrium-e2e")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout whose `atrium` runs (its .venv)")
    parser.add_argument("--out", default="e2e_peer")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    spans = Spans()
    try:
        results = [compare(size, args.work, args.concurrency, args.rounds, args.tokens,
                           args.root, spans) for size in args.sizes]
    finally:
        spans.close()
    import transformers

    path = write_result(args.out, {
        "peer": f"transformers serve --continuous-batching (transformers "
                f"{transformers.__version__}, CPU)",
        "root": str(args.root), "tokens": args.tokens, "rounds": args.rounds,
        "checkpoints": results})
    print(path)


if __name__ == "__main__":
    main()
