"""Writing requests' events and settling their entries in the request stream.

Every event an engine writes goes through ``EventWriter``, which owns each open
request's next ``seq``, so a request's events are numbered 0, 1, 2, ... with no
gap. A final event (finish or error) is written in one MULTI/EXEC with the
XACK and XDEL of the request's entry.

NOTE: that atomicity is what recovery relies on: a request whose entry is still
pending has no final event, so a dead engine's request is never finished twice.

Every write is one batch (one MULTI/EXEC), queued in ``backlog`` before it is
sent and taken off only once Redis answered it. While Redis is unreachable the
batches wait there, in order, and ``flush`` sends them first when it answers
again; numbers, the open set and usage are fixed when a batch is made, so the
backlog never leaves a gap. Each batch also sets this writer's marker key to the
batch's number, in the same transaction: after an EXEC whose reply was lost,
one GET tells which held batches Redis already has, so none is written twice.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis

from engine import protocol, tracing
from engine.outputs import RequestOutput, Usage

log = logging.getLogger(__name__)

# Redis did not answer: the batch is held and sent again (after the marker check).
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)
_MARKER_TTL_S = 24 * 3600  # longer than any outage a held batch could outlive
# A stream's EXPIRE is sent with its first write, its last, and once this long after the
# one before (each step wrote one per stream: half of a step's commands); its TTL
# (protocol.EVENTS_TTL_S) is five times longer.
_EXPIRE_EVERY_S = 60.0


class Entry(NamedTuple):
    """Where a request came from: its entry in a request stream (the model's, or an
    engine's; docs/protocol.md)."""

    stream: str
    entry_id: bytes


@dataclass(slots=True)
class _Open:
    entry: Entry  # the request's entry, acknowledged with its final event
    request: protocol.EngineRequest
    next_seq: int = 0
    expired_at: float = float("-inf")  # monotonic: when its stream's TTL was last set


@dataclass(slots=True)
class _Batch:
    """One MULTI/EXEC of writes, held until Redis has taken it."""

    number: int
    commands: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    reported: list[str] = field(default_factory=list)  # requests whose usage report it holds
    news: dict[str, dict[str, int]] = field(default_factory=dict)  # notify stream -> ids

    def add(self, command: str, *args: Any, **kwargs: Any) -> None:
        self.commands.append((command, args, kwargs))

    def add_event(self, model: str, request_id: str, event: protocol.Event,
                  notify: str | None, expire: bool = True) -> None:
        events = protocol.events_stream(model, request_id)
        self.add("xadd", events, event.encode())
        if expire:
            self.add("expire", events, protocol.EVENTS_TTL_S)
        if notify:
            self.news.setdefault(notify, {})[request_id] = 1

    def seal(self, expired_at: dict[str, float], now: float) -> None:
        """Tells each reader, in one entry, which of its requests this batch wrote to
        (``expired_at``: when each notify stream's TTL was last set, kept up to date)."""
        for notify, request_ids in self.news.items():
            self.add("xadd", notify, request_ids, maxlen=protocol.NOTIFY_STREAM_MAXLEN,
                     approximate=True)
            if now - expired_at.get(notify, float("-inf")) >= _EXPIRE_EVERY_S:
                self.add("expire", notify, protocol.EVENTS_TTL_S)
                expired_at[notify] = now
        self.news = {}


class EventWriter:
    """One engine's writes. NOTE: every key a batch touches is in its model's slot
    (protocol.model_prefix): the events and notify streams, the usage stream, the request
    streams whose entries it acknowledges, and the marker; so a batch is one MULTI on Redis Cluster
    too."""

    def __init__(self, client: redis.Redis, *, model: str, engine_id: str,
                 wait_replicas: int = 0, wait_ms: int = 100) -> None:
        self.client = client
        self.model = model
        self.usage_stream = protocol.usage_stream(model)  # named to billing each heartbeat
        # With replicas (Redis Sentinel): a batch that reports usage is confirmed by this
        # many of them (WAIT) before it counts as written, so a failover right after it
        # cannot lose a bill (docs/deploy.md#redis-high-availability).
        self.wait_replicas = wait_replicas
        self.wait_ms = wait_ms
        self.open: dict[str, _Open] = {}  # accepted, not yet finished
        self.tokens_written = 0
        self.finished = 0
        self.backlog: deque[_Batch] = deque()  # made, not yet taken by Redis; oldest first
        self.marker_key = protocol.engine_writes_key(model, engine_id)
        self._epoch = secrets.token_hex(8)  # this writer's batches, not an earlier process's
        self._made = 0
        self._unsure = False  # an EXEC failed without a reply: it may have been applied
        self._notify_expired: dict[str, float] = {}  # notify stream -> when its TTL was set

    def accept(self, entry: Entry, request: protocol.EngineRequest, engine_id: str,
               first_seq: int = 0) -> None:
        self.open[request.request_id] = _Open(entry, request, next_seq=first_seq)
        batch = self._batch()
        self._append(batch, request.request_id, protocol.EV_ACCEPTED, {"engine_id": engine_id})
        self._send(batch)

    def publish(self, outputs: list[RequestOutput],
                error_code: str = protocol.ERROR_ENGINE) -> None:
        """One step's outputs as events: a delta when there is news, then the final event."""
        outputs = [out for out in outputs if out.request_id in self.open]
        if not outputs:
            return
        batch = self._batch()
        for out in outputs:
            self.tokens_written += len(out.token_ids)
            # NOTE: prompt logprobs are written even on an output with no text or tokens.
            if out.text_delta or out.token_ids or out.prompt_logprobs is not None:
                data: dict[str, Any] = {"text": out.text_delta, "token_ids": out.token_ids}
                if out.logprobs is not None:
                    data["logprobs"] = [[lp.logprob, [list(pair) for pair in lp.top]]
                                        for lp in out.logprobs]
                if out.prompt_logprobs is not None:
                    data["prompt_logprobs"] = [[lp.logprob, lp.rank,
                                                [list(pair) for pair in lp.top]]
                                               for lp in out.prompt_logprobs]
                if self.open[out.request_id].request.num_choices > 1:
                    data["index"] = out.index
                self._append(batch, out.request_id, protocol.EV_DELTA, data)
            if out.finished:
                self._append_final(batch, out, error_code)
        self._send(batch)

    def finish_unstarted(self, entry: Entry, request_id: str, event_type: str,
                         data: dict[str, Any], notify: str | None = None, seq: int = 0) -> None:
        """A request that never entered the engine: its final event, no usage."""
        event = protocol.Event(seq, event_type, {**data, "usage": Usage().to_dict()})
        self.write_final(entry, request_id, event, notify=notify)

    def write_final(self, entry: Entry, request_id: str, event: protocol.Event,
                    request: protocol.EngineRequest | None = None,
                    notify: str | None = None) -> None:
        """``request`` given: it had been accepted, so its usage is reported for billing."""
        batch = self._batch()
        notify = notify or (request and request.notify)
        # NOTE: only this model's notify streams: a request of another model (refused) names
        # its own, in another Redis Cluster slot than this batch's MULTI.
        if notify and not notify.startswith(protocol.notify_stream(self.model, "")):
            notify = None
        batch.add_event(self.model, request_id, event, notify)
        if request is not None:
            self._report_usage(batch, request, event)
        self._acknowledge(batch, entry)
        self.finished += 1
        self._send(batch)

    def drop(self, entry: Entry) -> None:
        """Takes an entry off its stream and out of the pending list, writing nothing."""
        batch = self._batch()
        self._acknowledge(batch, entry)
        self._send(batch)

    def move(self, entry: Entry, fields: Any, stream: str) -> None:
        """Hands an entry read but never started to ``stream`` (an engine that drains gives
        back what was placed on it), in one transaction: it is in exactly one place."""
        batch = self._batch()
        batch.add("xadd", stream, fields, maxlen=protocol.REQUEST_STREAM_MAXLEN,
                  approximate=True)
        self._acknowledge(batch, entry)
        self._send(batch)

    def flush(self) -> None:
        """Writes the held batches, oldest first.

        Raises ``redis.ConnectionError`` or ``redis.TimeoutError`` while Redis does not
        answer; the batches not written stay held, in order.
        """
        if self._unsure:
            self._forget_applied()
        while self.backlog:
            self._execute(self.backlog[0])
            self.backlog.popleft()

    def _batch(self) -> _Batch:
        self._made += 1
        return _Batch(self._made)

    def _send(self, batch: _Batch) -> None:
        now = time.monotonic()
        if len(self._notify_expired) > 1000:  # readers come and go: forget the long gone
            self._notify_expired = {k: t for k, t in self._notify_expired.items()
                                    if now - t < protocol.EVENTS_TTL_S}
        batch.seal(self._notify_expired, now)
        self.backlog.append(batch)
        self.flush()

    def _execute(self, batch: _Batch) -> None:
        with self.client.pipeline(transaction=True) as pipe:
            for command, args, kwargs in batch.commands:
                getattr(pipe, command)(*args, **kwargs)
            pipe.set(self.marker_key, f"{self._epoch}:{batch.number}", ex=_MARKER_TTL_S)
            try:
                replies = pipe.execute(raise_on_error=False)
                if batch.reported and self.wait_replicas:
                    self._confirm(batch)
            except UNREACHABLE:
                self._unsure = True
                raise
        # The transaction ran: a command that failed in it (an XACK on a consumer group a
        # restarted Redis no longer has) changes nothing a retry could mend.
        for (command, _args, _kwargs), reply in zip(batch.commands, replies[:-1], strict=True):
            if isinstance(reply, redis.ResponseError):
                log.warning("%s in a batch of events failed: %s", command.upper(), reply)

    def _confirm(self, batch: _Batch) -> None:
        """Waits for the replicas to hold ``batch``. The master gone meanwhile raises (the
        batch is then unsure: the marker on whichever master answers next says whether it
        survived the failover, and it is written again if not). Replicas merely late are
        logged and passed: a master whose replica is down keeps serving."""
        if isinstance(self.client, redis.RedisCluster):  # the shard the batch went to
            confirmed = self.client.execute_command(
                "WAIT", self.wait_replicas, self.wait_ms,
                target_nodes=self.client.get_node_from_key(self.marker_key))
        else:
            confirmed = self.client.wait(self.wait_replicas, self.wait_ms)
        if confirmed < self.wait_replicas:
            log.warning("batch %d of events (%d usage report(s)) reached %d of %d replica(s) "
                        "within %d ms", batch.number, len(batch.reported), confirmed,
                        self.wait_replicas, self.wait_ms)

    def _forget_applied(self) -> None:
        """Drops the held batches Redis already applied (their EXEC's reply was lost)."""
        raw = self.client.get(self.marker_key)
        epoch, _, number = (raw or b"").decode().partition(":")
        if epoch == self._epoch:
            while self.backlog and self.backlog[0].number <= int(number):
                log.info("batch %d of events was written before Redis went away",
                         self.backlog.popleft().number)
        self._unsure = False

    def _append(self, batch: _Batch, request_id: str, event_type: str,
                data: dict[str, Any]) -> protocol.Event:
        state = self.open[request_id]
        event = protocol.Event(state.next_seq, event_type, data)
        now = time.monotonic()
        expire = event_type not in (protocol.EV_DELTA, protocol.EV_ACCEPTED) \
            or now - state.expired_at >= _EXPIRE_EVERY_S
        if expire:
            state.expired_at = now
        batch.add_event(self.model, request_id, event, state.request.notify, expire=expire)
        state.next_seq += 1
        return event

    def _report_usage(self, batch: _Batch, request: protocol.EngineRequest,
                      final: protocol.Event) -> None:
        # NOTE: in the same MULTI as the final event and the XACK: a request's usage is
        # reported exactly when its entry is acknowledged, so recovery can never report it twice.
        report = protocol.UsageReport(
            request_id=request.usage_id or request.request_id, tenant_id=request.tenant_id,
            model=request.model,
            usage=final.data.get("usage") or Usage().to_dict(), occurred_at=time.time(),
            api_key_id=request.api_key_id, adapter=request.adapter, user=request.user,
            price_class=request.price_class,
            finish_reason=final.data.get("finish_reason"), error_code=final.data.get("code"))
        batch.add("xadd", self.usage_stream, report.encode(),
                  maxlen=protocol.USAGE_STREAM_MAXLEN, approximate=True)
        batch.reported.append(request.request_id)
        # The one place every accepted request ends: its spans too, when tracing is on.
        if tracing.enabled():
            tracing.record_engine_request(
                traceparent=request.traceparent, request_id=request.request_id,
                model=request.model, adapter=request.adapter, usage=report.usage,
                finish_reason=report.finish_reason,
                error=final.data.get("message") if final.type == protocol.EV_ERROR else None)

    def _append_final(self, batch: _Batch, out: RequestOutput, error_code: str) -> None:
        usage = (out.usage or Usage()).to_dict()
        state = self.open[out.request_id]
        if out.error is not None:
            event = self._append(batch, out.request_id, protocol.EV_ERROR,
                                 {"code": out.error_code or error_code, "message": out.error,
                                  "usage": usage})
        else:
            data = {"finish_reason": out.finish_reason, "usage": usage}
            if out.stop_reason is not None:
                data["stop_reason"] = out.stop_reason
            if out.choices is not None:
                data["choices"] = out.choices
            if out.embeddings is not None:
                data["embeddings"] = out.embeddings
            event = self._append(batch, out.request_id, protocol.EV_FINISH, data)
        self._report_usage(batch, state.request, event)
        self._acknowledge(batch, self.open.pop(out.request_id).entry)
        self.finished += 1

    def _acknowledge(self, batch: _Batch, entry: Entry) -> None:
        batch.add("xack", entry.stream, protocol.ENGINE_GROUP, entry.entry_id)
        batch.add("xdel", entry.stream, entry.entry_id)
