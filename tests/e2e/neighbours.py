"""A quiet tenant and a hostile one on one running Atrium, driven only through what users
have: the `atrium` command, REST with a console session, the API with keys, streamed chat.

The hostile tenant's abuses (a webhook endpoint that trickles, an alert flood, huge
uploads, many batches with lines that fail, hostile `user` values, schemas that are slow
to compile) run in the background while :class:`Quiet` measures what the quiet tenant
gets: time to first token, how long its usage takes to reach the ledger, how long its
budget alert takes to reach its webhook. Shared by the noisy-neighbour tests
(tests/e2e/test_noisy_neighbours.py) and bench/isolation.py; nothing here imports the project.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socketserver
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.conftest import processes_of

PROMPT = [{"role": "user", "content": "Tell me about the sea"}]


# --- tenants, as their people reach them ---------------------------------------------------

@dataclass
class Seat:
    """A tenant: its API key (inference, usage, billing) and its owner's console session."""

    slug: str
    key: str
    key_id: int
    base: str
    console: httpx.Client

    def rest(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The management API as the signed-in owner (CSRF token from the session)."""
        headers = {"X-CSRFToken": self.console.cookies.get("csrftoken", ""),
                   "Referer": self.base + "/console/"}
        return self.console.request(method, f"/api/v1/tenants/{self.slug}{path}",
                                    headers=headers, **kwargs)

    def api(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=timeout,
                            headers={"Authorization": f"Bearer {self.key}"})


def seat(cli: Callable[..., Any], base: str, slug: str) -> Seat:
    """A new tenant ``slug`` with a key and an owner signed in to the console. ``cli``
    runs `atrium` with the platform's environment (args, input=...) -> CompletedProcess."""
    made = cli("create-tenant", slug)
    assert made.returncode == 0, made.stderr
    made = cli("create-key", slug, "--scopes", "inference,usage,billing", "--name", "bench")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]
    key_id = int(re.search(r"created key (\d+)", made.stderr).group(1))
    email, password = f"owner@{slug}.test", "a long enough pass phrase"
    made = cli("create-user", email, "--tenant", slug, "--role", "owner", "--password-stdin",
               input=f"{password}\n")
    assert made.returncode == 0, made.stderr
    console = httpx.Client(base_url=base, timeout=60)
    form = console.get("/console/login")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    signed_in = console.post("/console/login", data={
        "username": email, "password": password, "csrfmiddlewaretoken": token})
    assert signed_in.status_code == 302, signed_in.text[-2000:]
    return Seat(slug=slug, key=key, key_id=key_id, base=base, console=console)


def first_token(client: httpx.Client, model: str, *, max_tokens: int = 8,
                **extra: Any) -> tuple[float, str]:
    """(seconds to the first content chunk, the completion's id) of one streamed chat."""
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, **extra}
    began = time.monotonic()
    ttft, request_id = None, ""
    with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise AssertionError(f"{reply.status_code}: {reply.read()[-500:]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # an error event ends the stream: the probe records it
                raise AssertionError(f"error event after {time.monotonic() - began:.1f} s: "
                                     f"{chunk['error']}")
            request_id = chunk["id"]
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.monotonic() - began
    return (ttft if ttft is not None else time.monotonic() - began), request_id


# --- the quiet tenant's view ---------------------------------------------------------------

@dataclass
class Quiet:
    """Streams a short chat every ``interval`` seconds for as long as it runs, and follows
    each one's usage into the ledger."""

    seat: Seat
    model: str
    interval: float = 0.25
    # Each request's response_format, by its number (None: free text).
    response_format: Callable[[int], dict[str, Any]] | None = None
    ttfts: list[float] = field(default_factory=list)
    ledger_lags: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Quiet:
        self._threads = [threading.Thread(target=self._run, daemon=True)]
        self._threads[0].start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._threads[0].join(timeout=90)  # then no new request is followed
        for thread in self._threads[1:]:
            thread.join(timeout=90)

    def _run(self) -> None:
        with self.seat.api() as client:
            for n in range(10**9):
                if self._stop.is_set():
                    break
                began = time.monotonic()
                extra = {} if self.response_format is None else {
                    "response_format": self.response_format(n)}
                try:
                    ttft, request_id = first_token(client, self.model, **extra)
                except (httpx.HTTPError, AssertionError) as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}"[:300])
                else:
                    self.ttfts.append(ttft)
                    follow = threading.Thread(target=self._follow, daemon=True,
                                              args=(request_id, time.monotonic()))
                    self._threads.append(follow)
                    follow.start()
                self._stop.wait(max(0.0, self.interval - (time.monotonic() - began)))

    def _follow(self, request_id: str, finished: float, limit: float = 60.0) -> None:
        with self.seat.api(timeout=10) as client:
            while time.monotonic() - finished < limit:
                try:
                    reply = client.get(f"/api/v1/tenants/{self.seat.slug}/usage/requests/"
                                       f"{request_id}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"following {request_id}: {exc}"[:300])
                    break
                if reply.status_code == 200:
                    self.ledger_lags.append(time.monotonic() - finished)
                    return
                time.sleep(0.1)
        self.ledger_lags.append(float("inf"))

    def summary(self) -> dict[str, Any]:
        return {"requests": len(self.ttfts), "failures": len(self.failures),
                "ttft_p50_ms": _ms(percentile(self.ttfts, 50)),
                "ttft_p99_ms": _ms(percentile(self.ttfts, 99)),
                "ttft_max_ms": _ms(max(self.ttfts, default=0.0)),
                "ledger_lag_p50_s": round(percentile(self.ledger_lags, 50), 2),
                "ledger_lag_max_s": round(max(self.ledger_lags, default=0.0), 2)}


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


# --- webhook endpoints on loopback ---------------------------------------------------------

class Hooks(socketserver.ThreadingTCPServer):
    """A webhook receiver: ``trickle`` answers its headers and then one byte every
    ``every`` seconds, for ever; otherwise it answers 200 and keeps what it was sent."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, *, trickle: bool, every: float = 8.0) -> None:
        self.trickle, self.every = trickle, every
        self.received: list[tuple[float, dict[str, Any]]] = []
        self.connections = 0
        self.closing = threading.Event()
        super().__init__(("127.0.0.1", 0), _HookHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"

    def close(self) -> None:
        self.closing.set()
        self.shutdown()
        self.server_close()


class _HookHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: Hooks = self.server  # type: ignore[assignment]
        server.connections += 1
        length = 0
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = self.rfile.read(length)
        if not server.trickle:
            server.received.append((time.monotonic(), json.loads(body)))
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            return
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n")
        try:
            while not server.closing.wait(server.every):
                self.wfile.write(b"x")
                self.wfile.flush()
        except OSError:
            pass  # the platform hung up: what it should do


# --- the hostile tenant's abuses -----------------------------------------------------------

@contextlib.contextmanager
def background(work: Callable[[threading.Event], None], threads: int = 1) -> Iterator[None]:
    """Runs ``work(stop)`` on ``threads`` threads for the block."""
    stop = threading.Event()
    running = [threading.Thread(target=work, args=(stop,), daemon=True)
               for _ in range(threads)]
    for thread in running:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in running:
            thread.join(timeout=120)


@contextlib.contextmanager
def trickling_webhooks_and_alert_flood(hostile: Seat, model: str, *, endpoints: int = 10,
                                       users_per_s: float = 10) -> Iterator[Hooks]:
    """Ten endpoints that trickle, and an each-end-user budget of one token: every new end
    user's request is refused at 100% of it, which is an alert, which is a delivery to each
    endpoint."""
    hooks = Hooks(trickle=True)
    for _ in range(endpoints):
        made = hostile.rest("POST", "/webhooks", json={"url": hooks.url})
        assert made.status_code == 201, made.text
    made = hostile.rest("POST", "/budgets", json={"scope": "user", "window": "day",
                                                  "token_limit": 1})
    assert made.status_code == 201, made.text
    counter = iter(range(10**9))

    def flood(stop: threading.Event) -> None:
        with hostile.api(timeout=30) as client:
            while not stop.wait(1 / users_per_s):
                client.post("/v1/chat/completions", json={
                    "model": model, "messages": PROMPT, "max_tokens": 1,
                    "user": f"flood-{next(counter)}"})

    try:
        with background(flood):
            yield hooks
    finally:
        hooks.close()


def batch_file(path: Path, *, megabytes: float, model: str) -> Path:
    """A valid batch input file of about ``megabytes`` (long prompts, so few lines)."""
    filler = "lorem ipsum dolor sit amet " * 400
    with path.open("w") as out:
        i = 0
        while out.tell() < megabytes * 1_000_000:
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                  "url": "/v1/chat/completions", "body": {
                                      "model": model, "max_tokens": 4, "messages": [
                                          {"role": "user", "content": filler}]}}) + "\n")
            i += 1
    return path


@contextlib.contextmanager
def huge_uploads(hostile: Seat, model: str, *, megabytes: float = 100,
                 count: int = 2) -> Iterator[list[int]]:
    """``count`` uploads of a ``megabytes`` batch file at once, again and again; yields the
    HTTP statuses as they finish."""
    folder = Path(tempfile.mkdtemp(prefix="atrium-uploads-"))
    source = batch_file(folder / "big.jsonl", megabytes=megabytes, model=model)
    statuses: list[int] = []

    def upload(stop: threading.Event) -> None:
        with hostile.api(timeout=600) as client:
            while not stop.is_set():
                with source.open("rb") as fh:
                    reply = client.post("/v1/files", data={"purpose": "batch"},
                                        files={"file": ("big.jsonl", fh)})
                statuses.append(reply.status_code)
                if reply.status_code == 200:
                    client.delete(f"/v1/files/{reply.json()['id']}")

    try:
        with background(upload, threads=count):
            yield statuses
    finally:
        source.unlink()
        os.rmdir(folder)


def hostile_lines(model: str, count: int) -> bytes:
    """Batch lines that fail when they run (a model that does not exist, a max_tokens
    beyond any limit) among lines that run for a while."""
    lines = []
    for i in range(count):
        body: dict[str, Any] = {"model": model, "max_tokens": 256, "messages": PROMPT}
        if i % 3 == 1:
            body["model"] = "no-such-model"
        elif i % 3 == 2:
            body["max_tokens"] = 10**9
        lines.append(json.dumps({"custom_id": f"h{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(lines) + "\n").encode()


@contextlib.contextmanager
def many_batches(hostile: Seat, model: str, *, batches: int = 20, lines: int = 30
                 ) -> Iterator[tuple[list[dict[str, Any]], list[int]]]:
    """As many batches as the tenant may hold, each with failing lines among working ones;
    yields the batch objects made and the statuses of the refusals, and cancels the
    batches after."""
    made: list[dict[str, Any]] = []
    refusals: list[int] = []
    with hostile.api() as client:
        for _ in range(batches):
            upload = client.post("/v1/files", data={"purpose": "batch"},
                                 files={"file": ("h.jsonl", hostile_lines(model, lines))})
            if upload.status_code != 200:
                refusals.append(upload.status_code)
                continue
            batch = client.post("/v1/batches", json={
                "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"})
            if batch.status_code == 200:
                made.append(batch.json())
            else:
                refusals.append(batch.status_code)
        try:
            yield made, refusals
        finally:
            for batch in made:
                client.post(f"/v1/batches/{batch['id']}/cancel")


HOSTILE_USERS = ["\ud800", "a\nb", "x" * 5000, "\x00", {"nested": "user"}]


@contextlib.contextmanager
def hostile_users(hostile: Seat, model: str, per_s: float = 20) -> Iterator[list[int]]:
    """Chats whose ``user`` is a lone surrogate, a newline, 5000 characters, a NUL, an
    object; yields the statuses they got."""
    statuses: list[int] = []

    def send(stop: threading.Event) -> None:
        with hostile.api(timeout=30) as client:
            i = 0
            while not stop.wait(1 / per_s):
                user = HOSTILE_USERS[i % len(HOSTILE_USERS)]
                i += 1
                body = json.dumps({"model": model, "messages": PROMPT, "max_tokens": 1,
                                   "user": user})  # escapes the surrogate, as JSON may
                statuses.append(client.post("/v1/chat/completions", content=body, headers={
                    "Content-Type": "application/json"}).status_code)

    with background(send):
        yield statuses


def slow_schema(seed: int, depth: int = 4) -> dict[str, Any]:
    """A JSON schema that takes the grammar compiler a while (about 5 s on one core of the
    2-core machine at depth 4, 190 KB): nested objects of bounded arrays, different each
    time so no cache answers it."""
    def level(at: int) -> dict[str, Any]:
        if at == 0:
            return {"type": "string", "pattern": f"[a-z]{{1,{20 + seed % 7}}}"}
        names = [f"f{seed}_{at}_{i}" for i in range(6)]
        return {"type": "object", "additionalProperties": False, "required": names,
                "properties": {name: {"type": "array", "maxItems": 12, "items": level(at - 1)}
                               for name in names}}
    return level(depth)


def quick_schema(seed: int) -> dict[str, Any]:
    """A small schema, new each time (so it is compiled, not cached): the quiet tenant's."""
    return {"type": "json_schema", "json_schema": {"name": "quick", "schema": {
        "type": "object", "additionalProperties": False, "required": [f"answer{seed}"],
        "properties": {f"answer{seed}": {"type": "string", "maxLength": 8}}}}}


@contextlib.contextmanager
def slow_schemas(hostile: Seat, model: str, per_s: float = 1) -> Iterator[list[int]]:
    """Structured-output requests, each with a new slow-to-compile schema, from two
    clients that give up after 10 s (a hang-up stops the request); yields the statuses
    (0: gave up)."""
    statuses: list[int] = []
    counter = iter(range(10**9))

    def send(stop: threading.Event) -> None:
        with hostile.api(timeout=10) as client:
            while not stop.wait(1 / per_s):
                try:
                    statuses.append(client.post("/v1/chat/completions", json={
                        "model": model, "messages": PROMPT, "max_tokens": 4,
                        "response_format": {"type": "json_schema", "json_schema": {
                            "name": "slow", "schema": slow_schema(next(counter))}}}
                    ).status_code)
                except httpx.TimeoutException:
                    statuses.append(0)

    with background(send, threads=2):
        yield statuses


# --- the web process ----------------------------------------------------------------------

def web_pid(root_pid: int) -> int:
    """The `atrium web` process under the `atrium up` whose process id is ``root_pid``."""
    [pid] = processes_of(root_pid, b"atrium.cli", b"web")
    return pid


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@contextlib.contextmanager
def rss_peak(pid: int, every: float = 0.1) -> Iterator[list[float]]:
    """Samples the process's resident memory for the block; yields [peak MB]."""
    peak = [rss_mb(pid)]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every):
            peak[0] = max(peak[0], rss_mb(pid))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


# --- the quiet tenant's alerts ------------------------------------------------------------

@dataclass
class QuietAlerts:
    """The quiet tenant's own budget alerts, to a webhook endpoint that answers at once:
    each probe is a new end user whose one-token budget refuses its first request."""

    seat: Seat
    model: str
    hooks: Hooks = field(default_factory=lambda: Hooks(trickle=False))
    latencies: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        made = self.seat.rest("POST", "/webhooks", json={"url": self.hooks.url})
        assert made.status_code == 201, made.text
        made = self.seat.rest("POST", "/budgets", json={"scope": "user", "window": "day",
                                                        "token_limit": 1})
        assert made.status_code == 201, made.text
        self._probes = iter(range(10**9))

    def probe(self, timeout: float = 60) -> float:
        """Seconds from the refused request to its alert at the tenant's endpoint."""
        user = f"alert-probe-{next(self._probes)}"
        with self.seat.api() as client:
            began = time.monotonic()
            refused = client.post("/v1/chat/completions", json={
                "model": self.model, "messages": PROMPT, "max_tokens": 1, "user": user})
        assert refused.status_code == 429, refused.text
        while time.monotonic() - began < timeout:
            for at, event in list(self.hooks.received):
                if event.get("data", {}).get("end_user") == user:
                    self.latencies.append(at - began)
                    return at - began
            time.sleep(0.05)
        self.latencies.append(float("inf"))
        return float("inf")

    def close(self) -> None:
        self.hooks.close()
