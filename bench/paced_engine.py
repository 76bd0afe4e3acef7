"""An engine worker whose model is a clock: every running request streams at a set rate.

For measuring the web tier alone (bench/concurrency.py, tests/e2e/test_stream_load.py):
the real worker loop, the real protocol over Redis, and an engine whose latency is fixed
and whose batch has no limit, so what varies is the web process. A request's first token
is made at the first step after it entered, the next ones every 1/tokens-per-s seconds
from there, so streams that started at different times make their tokens at different
times (``--lockstep``: every request gets its token in the same step, once a tick, as one
engine step for the whole batch would). Each token's text is " <when the request entered
the engine>/<when the token was made>" (unix seconds), so a client on the same machine can
tell the latency added outside the engine; a request finishes at its max_tokens.

    python -m bench.paced_engine --redis-url URL --model-name atrium-demo --tokens-per-s 20
"""

from __future__ import annotations

import argparse
import heapq
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine import protocol
from engine.outputs import PlainEngine, RequestOutput, Usage
from engine.worker import WorkerConfig, run_worker

TOKEN_ID = 7
MAX_NAP_S = 0.01


@dataclass(slots=True)
class _Running:
    request: protocol.EngineRequest
    added_at: float
    added_wall: float
    made: int = 0
    first_at: float | None = None


class PacedEngine(PlainEngine):
    """The EngineCore interface (engine/outputs.py) at a fixed pace, without a model."""

    def __init__(self, tokens_per_s: float, *, lockstep: bool = False) -> None:
        self.interval = 1.0 / tokens_per_s
        self.lockstep = lockstep
        self.running: dict[str, _Running] = {}
        self._due: list[tuple[float, int, str]] = []  # (when, order, request id), a heap
        self._order = 0
        self._next_tick = time.monotonic()

    def add_request(self, request: protocol.EngineRequest) -> None:
        if request.sampling.n != 1 or request.extra_prompts:
            raise ValueError("the paced engine generates one choice per request")
        now = time.monotonic()
        self.running[request.request_id] = _Running(request, now, time.time())
        self._schedule(now, request.request_id)

    def abort_request(self, request_id: str, reason: str) -> RequestOutput | None:
        run = self.running.pop(request_id, None)
        return None if run is None else self._final(run, reason)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return 0

    def room(self) -> int:
        return 1_000_000

    def step(self) -> list[RequestOutput]:
        due = self._take_due()
        if due is None:
            return []
        outputs = []
        for request_id in due:
            run = self.running.get(request_id)
            if run is None:  # aborted since it was scheduled
                continue
            run.made += 1
            run.first_at = run.first_at or time.monotonic()
            done = run.made >= run.request.sampling.max_tokens
            out = RequestOutput(request_id, text_delta=f" {run.added_wall:.6f}/{time.time():.6f}",
                                token_ids=[TOKEN_ID])
            if done:
                del self.running[request_id]
                final = self._final(run, protocol.FINISH_LENGTH)
                out.finished, out.finish_reason, out.usage = True, final.finish_reason, \
                    final.usage
            else:
                self._schedule(run.added_at + run.made * self.interval, request_id)
            outputs.append(out)
        return outputs

    def _schedule(self, when: float, request_id: str) -> None:
        if not self.lockstep:
            self._order += 1
            heapq.heappush(self._due, (when, self._order, request_id))

    def _take_due(self) -> list[str] | None:
        """The requests whose token is due now, or None after a short nap when none is.

        NOTE: the nap is short: the worker's loop takes new requests between steps, as it
        does between a real engine's steps."""
        now = time.monotonic()
        if self.lockstep:
            if now < self._next_tick:
                time.sleep(min(self._next_tick - now, MAX_NAP_S))
                if time.monotonic() < self._next_tick:
                    return None
            self._next_tick = max(self._next_tick + self.interval, time.monotonic())
            return list(self.running)
        if not self._due or self._due[0][0] > now:
            if self._due:
                time.sleep(min(self._due[0][0] - now, MAX_NAP_S))
            now = time.monotonic()
        due = []
        while self._due and self._due[0][0] <= now:
            due.append(heapq.heappop(self._due)[2])
        return due or None

    def _final(self, run: _Running, reason: str) -> RequestOutput:
        now = time.monotonic()
        usage = Usage(prompt_tokens=len(run.request.prompt_token_ids),
                      completion_tokens=run.made,
                      ttft_s=None if run.first_at is None else run.first_at - run.added_at,
                      total_s=now - run.added_at)
        return RequestOutput(run.request.request_id, finished=True, finish_reason=reason,
                             usage=usage)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.paced_engine")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--tokens-per-s", type=float, default=20.0)
    parser.add_argument("--lockstep", action="store_true",
                        help="every request's token in the same step, once a tick")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_worker(redis_url=args.redis_url, model_dir=Path("."), model_name=args.model_name,
               stop=stop, engine_factory=lambda _: PacedEngine(args.tokens_per_s,
                                                      lockstep=args.lockstep),
               config=WorkerConfig(idle_block_ms=20))


if __name__ == "__main__":
    main()
