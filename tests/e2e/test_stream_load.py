"""Bursts of streams against one web process: every stream finishes or gets an intended 429.

One `atrium web` process, a Redis server of the test's own and an engine worker whose model
is a clock (bench/paced_engine.py: the real worker loop and protocol, a fixed pace, no batch
limit), so the web tier is what is loaded. The tenant's limits are raised with the
operator's `atrium set-limits`. Loopback only; every burst is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import websockets

from tests.e2e.conftest import (
    BIN,
    ROOT,
    _seed_model_cache,
    free_port,
    user_env,
    wait_for,
)
from tests.redis_server import RedisServer

MODEL = "atrium-demo"
MAX_TOKENS = 16
TOKENS_PER_S = 8.0
SOCKETS = 63
PER_SOCKET = 16  # the websocket's own limit of requests in flight (docs/api.md)
BURST_TIMEOUT_S = 300


@dataclass
class Fleet:
    base: str
    redis: RedisServer
    web: subprocess.Popen
    key: str  # a tenant whose limits were raised
    small_key: str  # a tenant on the default plan: 64 concurrent requests
    log: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def web_connections(self) -> int:
        """Redis connections the web process holds (its clients are named by pid)."""
        name = f"atrium-{self.web.pid}"
        with self.redis.client() as client:
            return sum(1 for c in client.client_list() if c.get("name") == name)


def _cli(env: dict[str, str], home: Path, *args: str) -> str:
    done = subprocess.run([str(BIN / "atrium"), *args], env=env, cwd=home,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"atrium {' '.join(args)}: {done.stderr[-2000:]}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    home = tmp_path_factory.mktemp("stream-load")
    redis = RedisServer(home, persistent=False)
    redis.start()
    env = user_env(home, REDIS_URL=redis.url)
    _seed_model_cache(home)
    procs: list[subprocess.Popen] = []
    try:
        _cli(env, home, "build-demo-model")
        _cli(env, home, "migrate", "--verbosity", "0")
        _cli(env, home, "create-tenant", "Load", "--slug", "load")
        _cli(env, home, "set-limits", "load", "--max-concurrent-requests", "5000",
             "--requests-per-minute", "100000", "--tokens-per-minute", "10000000")
        key = _cli(env, home, "create-key", "load").split()[-1]
        _cli(env, home, "create-tenant", "Small", "--slug", "small")
        small_key = _cli(env, home, "create-key", "small").split()[-1]
        port = free_port()
        # NOTE: its log to a file: a pipe nobody reads would fill and stall the process.
        web_log = (home / "web.log").open("w")
        web = subprocess.Popen([str(BIN / "atrium"), "web", "--port", str(port)], env=env,
                               cwd=home, stdout=web_log, stderr=subprocess.STDOUT)
        procs.append(web)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "bench.paced_engine", "--redis-url", redis.url,
             "--model-name", MODEL, "--tokens-per-s", str(TOKENS_PER_S)],
            env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert web.poll() is None, \
                f"atrium web exited:\n{(home / 'web.log').read_text()[-4000:]}"
            try:
                return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=120, interval=0.5, what="atrium web and the engine")
        yield Fleet(base, redis, web, key, small_key, home / "web.log", procs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.process.kill()
        redis.process.wait()


def _outcome(error: BaseException | None, tokens: int = 0) -> str:
    if error is None:
        return "ok" if tokens == MAX_TOKENS else f"short:{tokens}"
    if isinstance(error, openai.APIStatusError):
        return str(error.status_code)
    return type(error).__name__


async def _sse_stream(client: openai.AsyncOpenAI, i: int) -> str:
    tokens = 0
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=MAX_TOKENS, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                tokens += 1
    except Exception as exc:  # noqa: BLE001 - counted, never hidden
        return _outcome(exc)
    return _outcome(None, tokens)


async def _socket(base: str, key: str, first: int, count: int) -> list[str]:
    """`count` streams at once on one websocket; the outcome of each."""
    url = base.replace("http", "ws", 1) + "/v1/stream"
    tokens: dict[str, int] = collections.defaultdict(int)
    outcome: dict[str, str] = {}
    try:
        async with websockets.connect(url, additional_headers={
                "Authorization": f"Bearer {key}"}, max_size=2**20) as ws:
            for i in range(first, first + count):
                await ws.send(json.dumps({
                    "type": "request", "id": str(i), "endpoint": "chat.completions",
                    "body": {"model": MODEL, "max_tokens": MAX_TOKENS,
                             "messages": [{"role": "user", "content": f"socket {i}"}]}}))
            while len(outcome) < count:
                message = json.loads(await ws.recv())
                sid = message.get("id")
                if message["type"] == "chunk":
                    choices = message["data"].get("choices") or []
                    if choices and choices[0]["delta"].get("content"):
                        tokens[sid] += 1
                elif message["type"] == "done":
                    outcome[sid] = "ok" if tokens[sid] == MAX_TOKENS else f"short:{tokens[sid]}"
                elif message["type"] == "error":
                    outcome[sid or "?"] = str(message["status"])
    except Exception as exc:  # noqa: BLE001 - counted, never hidden
        return [type(exc).__name__] * (count - len(outcome)) + list(outcome.values())
    return list(outcome.values())


async def _burst(fleet: Fleet, *, sse: int, sockets: int, key: str) -> tuple[
        collections.Counter, int]:
    """Opens ``sse`` SSE streams and ``sockets`` websockets of up to 16 streams each, all at
    once; the outcomes and the most Redis connections the web process held meanwhile."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=sse + 10),
                             timeout=httpx.Timeout(BURST_TIMEOUT_S, connect=30))
    client = openai.AsyncOpenAI(base_url=f"{fleet.base}/v1", api_key=key, max_retries=0,
                                http_client=http)
    most = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, await asyncio.to_thread(fleet.web_connections))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    per_socket = [min(PER_SOCKET, 1000 - PER_SOCKET * s) for s in range(sockets)]
    jobs = [_sse_stream(client, i) for i in range(sse)]
    jobs += [_socket(fleet.base, key, 100_000 + PER_SOCKET * s, n)
             for s, n in enumerate(per_socket)]
    try:
        results = await asyncio.wait_for(asyncio.gather(*jobs), BURST_TIMEOUT_S)
    finally:
        done.set()
        await sampler
        await http.aclose()
    outcomes = collections.Counter()
    for result in results:
        outcomes.update(result if isinstance(result, list) else [result])
    return outcomes, most


def test_a_thousand_sse_and_a_thousand_websocket_streams_all_finish(fleet: Fleet) -> None:
    started = time.monotonic()
    outcomes, connections = asyncio.run(_burst(fleet, sse=1000, sockets=SOCKETS,
                                               key=fleet.key))
    elapsed = time.monotonic() - started
    assert outcomes == {"ok": 2000}, f"{dict(outcomes)} in {elapsed:.0f}s"
    # The streams did not each hold a Redis connection: the event loop's pool stayed within
    # its bound (ATRIUM_REDIS_MAX_CONNECTIONS, 64), plus the few of the worker threads.
    assert connections <= 64 + 8, connections
    assert fleet.web.poll() is None


def test_a_burst_past_the_tenants_limit_gets_429s_and_no_server_errors(fleet: Fleet) -> None:
    outcomes, _ = asyncio.run(_burst(fleet, sse=300, sockets=0, key=fleet.small_key))
    # The default plan allows 64 at once; the rest are the intended 429, nothing else.
    assert set(outcomes) <= {"ok", "429"}, dict(outcomes)
    assert outcomes["ok"] >= 64, dict(outcomes)
