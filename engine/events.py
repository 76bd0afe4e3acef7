"""Writing requests' events and settling their entries in the request stream.

Every event an engine writes goes through ``EventWriter``, which owns each open
request's next ``seq``, so a request's events are numbered 0, 1, 2, ... with no
gap. A final event (finish or error) is written in one MULTI/EXEC with the
XACK and XDEL of the request's entry.

NOTE: that atomicity is what recovery relies on: a request whose entry is still
pending has no final event, so a dead engine's request is never finished twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from engine import protocol
from engine.outputs import RequestOutput, Usage


@dataclass(slots=True)
class _Open:
    entry_id: bytes  # the request's entry in the request stream
    request: protocol.EngineRequest
    next_seq: int = 0


class EventWriter:
    def __init__(self, client: redis.Redis, stream: str) -> None:
        self.client = client
        self.stream = stream
        self.open: dict[str, _Open] = {}  # accepted, not yet finished
        self.tokens_written = 0
        self.finished = 0

    def accept(self, entry_id: bytes, request: protocol.EngineRequest, engine_id: str) -> None:
        self.open[request.request_id] = _Open(entry_id, request)
        with self.client.pipeline(transaction=False) as pipe:
            self._append(pipe, request.request_id, protocol.EV_ACCEPTED, {"engine_id": engine_id})
            pipe.execute()

    def publish(self, outputs: list[RequestOutput],
                error_code: str = protocol.ERROR_ENGINE) -> None:
        """One step's outputs as events: a delta when there is news, then the final event."""
        outputs = [out for out in outputs if out.request_id in self.open]
        if not outputs:
            return
        with self.client.pipeline(transaction=True) as pipe:
            for out in outputs:
                self.tokens_written += len(out.token_ids)
                if out.text_delta or out.token_ids:
                    self._append(pipe, out.request_id, protocol.EV_DELTA,
                                 {"text": out.text_delta, "token_ids": out.token_ids})
                if out.finished:
                    self._append_final(pipe, out, error_code)
            pipe.execute()

    def finish_unstarted(self, entry_id: bytes, request_id: str, event_type: str,
                         data: dict[str, Any]) -> None:
        """A request that never entered the engine: its only event, at seq 0, no usage."""
        event = protocol.Event(0, event_type, {**data, "usage": Usage().to_dict()})
        self.write_final(entry_id, request_id, event)

    def write_final(self, entry_id: bytes, request_id: str, event: protocol.Event,
                    request: protocol.EngineRequest | None = None) -> None:
        """``request`` given: it had been accepted, so its usage is reported for billing."""
        events = protocol.events_stream(request_id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(events, event.encode())
            pipe.expire(events, protocol.EVENTS_TTL_S)
            if request is not None:
                self._report_usage(pipe, request, event)
            self._settle(pipe, entry_id)
            pipe.execute()
        self.finished += 1

    def drop(self, entry_id: bytes) -> None:
        """Takes an entry off the stream and out of the pending list, writing nothing."""
        with self.client.pipeline(transaction=True) as pipe:
            self._settle(pipe, entry_id)
            pipe.execute()

    def _append(self, pipe: Any, request_id: str, event_type: str,
                data: dict[str, Any]) -> protocol.Event:
        state = self.open[request_id]
        events = protocol.events_stream(request_id)
        event = protocol.Event(state.next_seq, event_type, data)
        pipe.xadd(events, event.encode())
        pipe.expire(events, protocol.EVENTS_TTL_S)
        state.next_seq += 1
        return event

    def _report_usage(self, pipe: Any, request: protocol.EngineRequest,
                      final: protocol.Event) -> None:
        # NOTE: in the same MULTI as the final event and the XACK: a request's usage is
        # reported exactly when it is settled, so recovery can never report it twice.
        report = protocol.UsageReport(
            request_id=request.request_id, tenant_id=request.tenant_id, model=request.model,
            usage=final.data.get("usage") or Usage().to_dict(), occurred_at=time.time(),
            api_key_id=request.api_key_id, adapter=request.adapter,
            finish_reason=final.data.get("finish_reason"), error_code=final.data.get("code"))
        pipe.xadd(protocol.USAGE_STREAM, report.encode(),
                  maxlen=protocol.USAGE_STREAM_MAXLEN, approximate=True)

    def _append_final(self, pipe: Any, out: RequestOutput, error_code: str) -> None:
        usage = (out.usage or Usage()).to_dict()
        state = self.open[out.request_id]
        if out.error is not None:
            event = self._append(pipe, out.request_id, protocol.EV_ERROR,
                                 {"code": out.error_code or error_code, "message": out.error,
                                  "usage": usage})
        else:
            event = self._append(pipe, out.request_id, protocol.EV_FINISH,
                                 {"finish_reason": out.finish_reason, "usage": usage})
        self._report_usage(pipe, state.request, event)
        self._settle(pipe, self.open.pop(out.request_id).entry_id)
        self.finished += 1

    def _settle(self, pipe: Any, entry_id: bytes) -> None:
        pipe.xack(self.stream, protocol.ENGINE_GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
