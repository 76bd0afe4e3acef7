"""The engine worker: requests in from Redis, engine steps, events out (docs/protocol.md).

Redis I/O only; what runs the model hides behind ``EngineCore``. Each turn of
the loop: write what Redis could not take before → heartbeat (every second) →
recover dead engines' requests (now and then) → take new requests → abort
cancelled ones → ``engine.step()`` → publish.

While Redis does not answer, the engine takes no step: the loop retries every
``reconnect_wait_s``, and once Redis has been silent for ``publish_grace_s`` it
stops every request it holds with ``events_unavailable``; their final events and
usage reports wait in the event writer's backlog until Redis answers again
(docs/protocol.md, "When Redis is unreachable").
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine import protocol, tracing
from engine.events import UNREACHABLE, EventWriter
from engine.intake import Intake
from engine.metrics import PhaseClock
from engine.options import (
    EngineFactory,
    add_engine_arguments,
    default_engine_factory,
    engine_factory_from_args,
)
from engine.outputs import EngineCore, RequestOutput, Usage
from engine.recovery import Recovery
from engine.redis_connect import RedisTarget
from engine.streams import RequestStreams

log = logging.getLogger(__name__)

CANCELS_READ = 1000  # cancels read per step at most; the rest the step after
LIVENESS_S = 60.0  # a loop stuck this long is not live (its probe fails)
EARLY_BEAT_S = 0.1  # an adapter's arrival or departure is heard this soon at most


@dataclass(slots=True)
class WorkerConfig:
    idle_block_ms: int = 150  # XREADGROUP BLOCK while the engine has nothing to do
    recovery_interval_s: float = 5.0
    # A pending entry is recovered once idle this long and its engine's heartbeat is stale.
    claim_min_idle_s: float = 3 * protocol.HEARTBEAT_TTL_S
    # Redis unreachable this long: every request held is stopped (events_unavailable).
    publish_grace_s: float = protocol.PUBLISH_GRACE_S
    reconnect_wait_s: float = 0.1  # between tries while Redis does not answer
    # Told to stop: takes nothing new and finishes what it holds for up to this long.
    drain_s: float = 30.0

    def __post_init__(self) -> None:
        if self.idle_block_ms < 1:
            raise ValueError("idle_block_ms must be >= 1")
        if self.recovery_interval_s <= 0 or self.claim_min_idle_s < 0:
            raise ValueError("recovery_interval_s must be > 0 and claim_min_idle_s >= 0")
        if self.publish_grace_s <= 0 or self.reconnect_wait_s <= 0:
            raise ValueError("publish_grace_s and reconnect_wait_s must be > 0")
        if self.drain_s < 0:
            raise ValueError("drain_s must be >= 0")


class Worker:
    def __init__(self, client: redis.Redis, engine: EngineCore, *, model_name: str,
                 engine_id: str, config: WorkerConfig, wait_replicas: int = 0) -> None:
        self.client = client
        self.engine = engine
        self.model_name = model_name
        self.engine_id = engine_id
        self.config = config
        self.streams = RequestStreams(client, model_name=model_name, engine_id=engine_id)
        self.cancels = protocol.cancels_stream(model_name)
        self.events = EventWriter(client, model=model_name, engine_id=engine_id,
                                  wait_replicas=wait_replicas)
        self.intake = Intake(client, engine, self.events, model_name=model_name,
                             engine_id=engine_id)
        self.recovery = Recovery(client, self.events, self.intake, model_name=model_name,
                                 engine_id=engine_id, claim_min_idle_s=config.claim_min_idle_s)
        self.started_at = time.time()
        self.steps = 0
        self._next_heartbeat = 0.0
        # The adapters the last heartbeat named, and when one may go out early for a change.
        self._beat_adapters: list[str] = []
        self._early_beat_from = 0.0
        self._next_recovery = 0.0
        self.last_snapshot: dict[str, Any] | None = None  # the engine's, as of the last heartbeat
        # Deletions before this engine started concern adapters it never loaded: it reads on
        # from the stream's last entry at start-up (run).
        self._adapter_events_id: bytes | str = "0-0"
        self._cancels_id: bytes | str = "0-0"  # likewise, the cancels stream's
        self._io_since = 0.0  # when the Redis calls under way began (monotonic)
        self._unreachable_since: float | None = None  # monotonic; None while Redis answers
        self._group_missing = False
        self.draining = False  # stopping: takes nothing new (heartbeat says so)
        self.registered = False  # a heartbeat went out since start-up
        self.last_turn = time.monotonic()  # when the loop last went round (liveness)
        # The loop's Redis phases (redis_in: what a turn reads and writes before its step;
        # events: the step's writes); the engine's own phases are in its snapshot.
        self.clock = PhaseClock()

    def run(self, stop: threading.Event) -> None:
        log.info("engine %s serving model %s", self.engine_id, self.model_name)
        self.streams.ensure_groups()
        self.heartbeat()
        self.streams.register()
        self._adapter_events_id = self._last_entry_id(protocol.ADAPTER_EVENTS_STREAM)
        # NOTE: before any request is taken: a cancel older than this is found by the
        # request's cancel key when it is taken.
        self._cancels_id = self._last_entry_id(self.cancels)
        self.recovery.run(own=True)  # what an earlier life of this engine_id left pending
        self._next_recovery = time.monotonic() + self.config.recovery_interval_s
        try:
            while not stop.is_set():
                self.turn()
            self.drain()
        finally:
            self.shutdown()

    def turn(self) -> None:
        """One turn of the loop, riding out what Redis does meanwhile."""
        self.last_turn = time.monotonic()
        try:
            self.tick()
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("a consumer group is missing on %s or %s; creating them again",
                        self.streams.own, self.streams.shared)
            self._group_missing = True
        except UNREACHABLE as exc:
            self.unreachable(exc)
            time.sleep(self.config.reconnect_wait_s)

    def drain(self) -> None:
        """Told to stop: takes no new request and finishes those it holds, for up to
        ``drain_s``; shutdown then fails what is left (engine_shutdown). The heartbeat says
        it drains, so the web tier sends it nothing more (docs/deploy.md, "Drain"), and
        what was placed on it and not read goes to the model's other engines."""
        self.draining = True
        deadline = time.monotonic() + self.config.drain_s
        held = len(self.events.open)
        log.info("engine %s draining: %d request(s) to finish within %.0f s", self.engine_id,
                 held, self.config.drain_s)
        with contextlib.suppress(*UNREACHABLE):
            self.heartbeat()
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            self.turn()

    def tick(self) -> None:
        self.clock.start()
        self._io_since = now = time.monotonic()
        self.events.flush()  # NOTE: raises while Redis is away, so no step runs into the void
        if self._unreachable_since is not None:
            self.reconnected()
        if self._group_missing:
            self.streams.ensure_groups()
            self._group_missing = False
        if now >= self._next_heartbeat:
            self.heartbeat()
        if now >= self._next_recovery and not self.draining:
            self.recovery.run()
            self.read_adapter_events()
            self._next_recovery = now + self.config.recovery_interval_s
        self.take()
        if self._adapters_moved(now):
            self.heartbeat()
        if self.engine.has_unfinished():
            self.clock.lap("redis_in")
            outputs = self.engine.step()
            self.clock.start()
            self._io_since = time.monotonic()
            self.events.publish(outputs)
            self.clock.lap("events")
            self.steps += 1

    def health(self) -> tuple[bool, bool]:
        """(live, ready) for the probes: live while the loop goes round (a forward pass
        takes well under LIVENESS_S); ready once registered, while Redis answers and it
        does not drain."""
        live = time.monotonic() - self.last_turn < LIVENESS_S
        ready = live and self.registered and not self.draining \
            and self._unreachable_since is None
        return live, ready

    def unreachable(self, exc: Exception) -> None:
        """Redis did not answer: past the grace period, stops every request held."""
        if self._unreachable_since is None:
            # NOTE: from when the calls that failed began, not when they failed: a call to a
            # silent server fails only after its socket timeout.
            self._unreachable_since = self._io_since
            log.warning("Redis does not answer (%s: %s); holding %d batch(es) of events and "
                        "retrying", type(exc).__name__, exc, len(self.events.backlog))
        if (self.events.open
                and time.monotonic() - self._unreachable_since >= self.config.publish_grace_s):
            self.abort_unpublishable()

    def abort_unpublishable(self) -> None:
        log.warning("stopping %d request(s): their events could not be written for %.1f s",
                    len(self.events.open), self.config.publish_grace_s)
        outputs = self._fail_open(protocol.ERROR_EVENTS_UNAVAILABLE,
                                  "the engine could not deliver this request's output")
        with contextlib.suppress(*UNREACHABLE):  # held: written first once Redis answers
            self.events.publish(outputs, error_code=protocol.ERROR_EVENTS_UNAVAILABLE)

    def reconnected(self) -> None:
        """Redis answers again, and has what was held: the engine takes up its work."""
        self.heartbeat()
        self.streams.ensure_groups()  # gone if Redis came back without its data
        self.streams.register()
        # Entries read but never started (a reply lost, a read cut short) are pending here.
        running = {state.entry for state in self.events.open.values()}
        self.recovery.run(own=True, skip=running)
        log.warning("Redis answers again after %.1f s",
                    time.monotonic() - (self._unreachable_since or 0.0))
        self._unreachable_since = None

    def _last_entry_id(self, stream: str) -> bytes | str:
        last = self.client.xrevrange(stream, count=1)
        return last[0][0] if last else "0-0"

    def read_adapter_events(self) -> None:
        """Adapters the platform deleted since the last look: the engine lets go of them."""
        reply = self.client.xread({protocol.ADAPTER_EVENTS_STREAM: self._adapter_events_id},
                                  count=1000)
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self._adapter_events_id = entry_id
                if fields.get(b"type") == b"deleted":
                    self.engine.forget_adapter(fields.get(b"adapter_hash", b"").decode())

    def heartbeat(self) -> None:
        now = time.time()
        queued = self.streams.queued()
        beat = protocol.EngineHeartbeat(
            engine_id=self.engine_id, model=self.model_name, started_at=self.started_at,
            sent_at=now, running=self.engine.num_running(), waiting=self.engine.num_waiting(),
            draining=self.draining, queued=queued, placement=self.placement(),
            stats={"steps": self.steps, "tokens_generated": self.events.tokens_written,
                   "requests_finished": self.events.finished,
                   "requests_stolen": self.streams.stolen, **self.engine_stats(queued)})
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(protocol.ENGINES_ZSET, {self.engine_id: now})
            pipe.set(protocol.engine_key(self.engine_id), beat.encode(),
                     ex=math.ceil(protocol.HEARTBEAT_TTL_S))
            # Billing reads the usage streams this set names: said again each heartbeat, so
            # a Redis that lost the set (restarted, failed over) learns it within a second.
            pipe.sadd(protocol.USAGE_STREAMS_KEY, self.events.usage_stream)
            pipe.execute()
        self.registered = True
        self._next_heartbeat = time.monotonic() + protocol.HEARTBEAT_INTERVAL_S
        self._early_beat_from = time.monotonic() + EARLY_BEAT_S
        self._beat_adapters = beat.placement.get("adapters") or []
        if self.draining:
            # Again each heartbeat: a web process may place work here until it reads this one.
            self.streams.hand_back(self.events)
        else:
            self.streams.see_peers()

    def _adapters_moved(self, now: float) -> bool:
        """An adapter began loading here or left host memory since the last heartbeat: the
        web tier hears it now, not up to a heartbeat later, so the next requests for it
        from any web process come here (inference/routing.py)."""
        return now >= self._early_beat_from \
            and self.engine.resident_adapters() != self._beat_adapters

    def placement(self) -> dict[str, Any]:
        """What the web tier places by; ``stream``: this engine reads its own stream;
        ``lanes``: it reads the service tiers' lanes."""
        return {"stream": True, "lanes": True, **self.engine.placement()}

    def engine_stats(self, queued: int) -> dict[str, Any]:
        """The engine's metrics snapshot, with what its streams add (Prometheus exports it)."""
        taken = self.engine.snapshot()
        if taken is None:
            return {}
        # NOTE: replaced whole, never mutated: the metrics thread reads it without a lock.
        phases = {k: round(v, 6) for k, v in self.clock.seconds.items()}
        self.last_snapshot = {**taken, "queued": queued, "requests_stolen": self.streams.stolen,
                              "step_seconds": {**taken.get("step_seconds", {}), **phases}}
        # NOTE: the tokens served by tenant are Prometheus's alone: a row per tenant would
        # make every heartbeat grow with the tenants an engine has served.
        return {"engine": {k: v for k, v in self.last_snapshot.items() if k != "served"}}

    def take(self) -> None:
        """Reads new requests (none while draining): blocking briefly when idle, not at all
        while generating; and the requests cancelled since, in the same round trip."""
        block = None if self.engine.has_unfinished() else self.config.idle_block_ms
        room = 0 if self.draining else self.engine.room()
        lanes = {lane: 0 if self.draining else self.engine.lane_room(lane)
                 for lane in protocol.LANES}
        taken, cancels = self.streams.read(room, block, lanes=lanes,
                                           also=(self.cancels, self._cancels_id, CANCELS_READ))
        if block is not None:
            self.clock.start()  # NOTE: an idle engine's wait for work is no step's phase
        for entry, fields in taken:
            request = self.intake.decode(entry, fields)
            if request is not None:
                self.intake.start(entry, request)
        self.abort_cancelled(cancels)

    def abort_cancelled(self, reply: Any) -> None:
        """Stops the requests cancelled since the last step (``reply``: one read of the
        model's cancels stream, whatever the number of requests held)."""
        cancelled: dict[str, None] = {}
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._cancels_id = entry_id
                rid = fields.get(b"request_id", b"").decode()
                if rid in self.events.open:
                    cancelled[rid] = None
        if cancelled:
            self.events.publish([self._abort(rid, protocol.FINISH_CANCELLED)
                                 for rid in cancelled])

    def shutdown(self) -> None:
        """Fails what is still in the engine, then leaves the set of live engines."""
        try:
            outputs = self._fail_open(protocol.ERROR_ENGINE_SHUTDOWN,
                                      "the engine shut down before the request finished")
            self.events.publish(outputs, error_code=protocol.ERROR_ENGINE_SHUTDOWN)
            self.events.flush()  # what an outage held, when nothing was left to publish
            # NOTE: not one MULTI: on Redis Cluster these keys are in different slots.
            with self.client.pipeline(transaction=False) as pipe:
                pipe.zrem(protocol.ENGINES_ZSET, self.engine_id)
                pipe.delete(protocol.engine_key(self.engine_id))
                pipe.delete(self.events.marker_key)
                pipe.execute()
            for stream in self.recovery.streams():
                self.recovery.forget_consumer(stream, self.engine_id)
        except redis.RedisError:
            log.warning("could not deregister engine %s cleanly", self.engine_id, exc_info=True)
        lost = [rid for batch in self.events.backlog for rid in batch.reported]
        if self.events.backlog:
            log.error("engine %s stopped with %d batch(es) of events unwritten; usage of %d "
                      "request(s) not reported: %s", self.engine_id, len(self.events.backlog),
                      len(lost), ", ".join(lost))
        log.info("engine %s stopped", self.engine_id)

    def _fail_open(self, reason: str, message: str) -> list[RequestOutput]:
        """Stops every request the engine holds; their final outputs, as errors."""
        outputs = [self._abort(rid, reason) for rid in list(self.events.open)]
        for out in outputs:
            out.error = message
        return outputs

    def _abort(self, request_id: str, reason: str) -> RequestOutput:
        out = self.engine.abort_request(request_id, reason)
        return out or RequestOutput(request_id, finished=True, finish_reason=reason,
                                    usage=Usage())


def redis_options(config: WorkerConfig) -> dict[str, Any]:
    """The worker's client: it fails fast and retries nothing itself.

    The worker's loop retries, and the event writer knows which writes may have landed
    when a reply was lost; redis-py's own retries (seconds of backoff by default) would
    resend a MULTI blindly and hide an outage past the grace period. A command waits at
    most the grace period for an answer (plus the loop's blocking read).
    """
    return {"retry": Retry(NoBackoff(), 0),
            "socket_connect_timeout": config.publish_grace_s,
            "socket_timeout": config.publish_grace_s + config.idle_block_ms / 1000}


def run_worker(*, redis_url: str, model_dir: Path, model_name: str,
               engine_id: str | None = None, stop: threading.Event | None = None,
               engine_factory: EngineFactory | None = None,
               config: WorkerConfig | None = None, metrics_port: int = 0,
               metrics_host: str = "127.0.0.1") -> None:
    """Serves ``model_name`` from ``model_dir`` until ``stop`` is set."""
    engine_id = engine_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    tracing.configure_from_env("atrium-engine")  # off unless the OTEL_* variables say so
    engine = (engine_factory or default_engine_factory)(Path(model_dir))
    config = config or WorkerConfig()
    target = RedisTarget.from_env(redis_url)
    client = target.client(**redis_options(config))
    worker = Worker(client, engine, model_name=model_name, engine_id=engine_id, config=config,
                    wait_replicas=target.wait_replicas)
    server = None
    if metrics_port:
        from engine.metrics_server import serve_metrics

        server = serve_metrics(lambda: worker.last_snapshot, worker.health, host=metrics_host,
                               port=metrics_port, model_name=model_name, engine=engine_id)
    try:
        worker.run(stop or threading.Event())
    finally:
        client.close()
        if server is not None:
            server.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.worker",
                                     description="Serve one model from a Redis request stream.")
    parser.add_argument("--redis-url",
                        default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--model-name", help="the name clients use (default: the folder name)")
    parser.add_argument("--engine-id", help="default: host-pid-random")
    parser.add_argument("--log-level", default="INFO")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    # One JSON line per record, through the platform's redaction (pure Python, no Django).
    from redaction.jsonlog import configure_logging

    configure_logging(args.log_level)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per weight load is noise in a service log
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_worker(redis_url=args.redis_url, model_dir=args.model_dir,
               model_name=args.model_name or args.model_dir.name, engine_id=args.engine_id,
               stop=stop, engine_factory=engine_factory_from_args(args),
               config=WorkerConfig(drain_s=args.drain_seconds),
               metrics_port=args.metrics_port, metrics_host=args.metrics_host)


if __name__ == "__main__":
    main()
