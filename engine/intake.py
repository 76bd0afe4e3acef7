"""Taking one entry of the request stream into the engine, or finishing it at once.

Both ways a request reaches an engine go through here: the worker's read of new
entries (``Worker.take``) and recovery of a dead engine's entries that were never
accepted (``Recovery.take_over``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from engine import protocol
from engine.events import Entry, EventWriter
from engine.outputs import EngineCore
from engine.sampling_params import MAX_N

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, client: redis.Redis, engine: EngineCore, events: EventWriter, *,
                 model_name: str, engine_id: str) -> None:
        self.client = client
        self.engine = engine
        self.events = events
        self.model_name = model_name
        self.engine_id = engine_id

    def decode(self, entry: Entry, fields: Any) -> protocol.EngineRequest | None:
        """The entry's request, or None after dropping a malformed entry (and saying so)."""
        message = "malformed request entry"
        try:
            request = protocol.EngineRequest.decode(fields)
            if not request.request_id:
                raise ValueError("request_id must be a non-empty string")
            return request
        except Exception as exc:  # noqa: BLE001 - whatever a client wrote, the worker stays up
            log.warning("dropping malformed request entry %s on %s", entry.entry_id,
                        entry.stream)
            if isinstance(exc, ValueError):
                message = f"{message}: {exc}"[:300]
        request_id = _request_id_of(fields)
        if request_id and request_id not in self.events.open:
            self.events.finish_unstarted(entry, request_id, protocol.EV_ERROR, {
                "code": protocol.ERROR_INVALID_REQUEST, "message": message})
        else:
            self.events.drop(entry)
        return None

    def start(self, entry: Entry, request: protocol.EngineRequest, first_seq: int = 0) -> None:
        """Accepts a request into the engine, or finishes it at once (cancelled, late,
        invalid). ``first_seq``: the number of its first event here (a request a dead engine
        had accepted continues its numbering, engine/recovery.py)."""
        rid = request.request_id
        if rid in self.events.open:
            log.warning("request %s is already running here; dropping entry %s", rid,
                        entry.entry_id)
            self.events.drop(entry)
            return
        refusal = None
        if self.client.exists(protocol.cancel_key(request.model, rid)):
            refusal = protocol.EV_FINISH, {"finish_reason": protocol.FINISH_CANCELLED}
        elif request.deadline is not None and time.time() >= request.deadline:
            refusal = protocol.EV_FINISH, {"finish_reason": protocol.FINISH_DEADLINE}
        elif request.version > protocol.PROTOCOL_VERSION:
            refusal = protocol.EV_ERROR, {"code": protocol.ERROR_INVALID_REQUEST,
                                          "message": f"protocol version {request.version} is "
                                                     f"newer than this engine's"}
        elif request.model != self.model_name:
            refusal = protocol.EV_ERROR, {"code": protocol.ERROR_INVALID_REQUEST,
                                          "message": f"this engine serves {self.model_name!r}"}
        else:
            try:
                self.engine.add_request(request)
            except ValueError as exc:
                refusal = protocol.EV_ERROR, {"code": protocol.ERROR_INVALID_REQUEST,
                                              "message": str(exc)}
            except Exception:  # noqa: BLE001 - refuse this request, keep serving the others
                log.exception("starting request %s failed", rid)
                refusal = protocol.EV_ERROR, {"code": protocol.ERROR_ENGINE,
                                              "message": "the engine could not start this request"}
        if refusal is not None:
            event_type, data = refusal
            if event_type == protocol.EV_FINISH and _several_choices(request):
                data["choices"] = [{"index": i, "finish_reason": data["finish_reason"],
                                    "cumulative_logprob": 0.0}
                                   for i in range(request.num_choices)]
            self.events.finish_unstarted(entry, rid, event_type, data,
                                         notify=request.notify, seq=first_seq)
        else:
            self.events.accept(entry, request, self.engine_id, first_seq=first_seq)


def _several_choices(request: protocol.EngineRequest) -> bool:
    """The request asks for more than one choice, within the limits (its final event lists
    them). An embed request has none: one vector per input."""
    n, extra = request.sampling.n, len(request.extra_prompts)
    return request.task == protocol.TASK_GENERATE and 1 <= n <= MAX_N and \
        extra <= protocol.MAX_EXTRA_PROMPTS and 1 < request.num_choices <= protocol.MAX_CHOICES


def _request_id_of(fields: Any) -> str | None:
    """The request id of an entry that did not decode, when one can be read safely."""
    try:
        value = json.loads(fields.get(b"data", fields.get("data"))).get("request_id")
    except Exception:  # noqa: BLE001
        return None
    return value if isinstance(value, str) and 0 < len(value) <= 200 else None
