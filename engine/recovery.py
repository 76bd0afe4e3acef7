"""Taking over the requests a dead engine left pending in the consumer group.

An entry stays in the group's pending list from XREADGROUP until the final
event's XACK. If its consumer's heartbeat has gone stale and the entry has sat
there long enough, a live engine claims it (XCLAIM with a minimum idle time, so
two engines never both win) and then:

- the events stream already ends in a final event → only XACK/XDEL the entry;
- it has a delta but no final event (the dead engine had streamed from it) → append
  ``error`` with code ``engine_lost``, continuing the seq, and XACK/XDEL;
- it has no delta (never accepted, or accepted and no token written yet) → run it as if
  it had just arrived, its events numbered on from the last: its client, still waiting
  for a first token, sees one answer (docs/protocol.md, "Recovery after an engine dies").

The web tier places most requests on one engine's own stream (inference/routing.py).
Those a dead engine never read are taken by a live peer and run as if placed there;
the dead engine's stream goes once it is empty and quiet.

NOTE: XPENDING + XCLAIM rather than XAUTOCLAIM: XAUTOCLAIM cannot tell a dead
owner from a live one still generating a long answer, and would steal the latter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any

import redis

from engine import protocol
from engine.events import Entry, EventWriter
from engine.intake import Intake
from engine.outputs import Usage

log = logging.getLogger(__name__)

_BATCH = 100


class Recovery:
    def __init__(self, client: redis.Redis, events: EventWriter, intake: Intake, *,
                 model_name: str, engine_id: str, claim_min_idle_s: float) -> None:
        self.client = client
        self.events = events
        self.intake = intake
        self.model_name = model_name
        self.shared = protocol.request_stream(model_name)
        self.registry = protocol.engine_streams_key(model_name)
        self.engine_id = engine_id
        self.claim_min_idle_s = claim_min_idle_s

    def streams(self) -> dict[str, str | None]:
        """Every request stream of the model: the shared one and the lanes (no owner), and
        each engine's, by its owner."""
        owners = sorted(protocol.as_text(e) for e in self.client.smembers(self.registry))
        lanes = {protocol.lane_stream(self.model_name, lane): None for lane in protocol.LANES}
        return {self.shared: None, **lanes,
                **{protocol.engine_stream(self.model_name, e): e for e in owners}}

    def run(self, *, own: bool = False, skip: Collection[Entry] = ()) -> int:
        """Claims and takes over dead engines' entries; returns how many it claimed.

        ``own``: this engine's own pending entries, at start-up: an earlier process
        with the same engine_id died holding them; or after Redis was unreachable, the
        entries it read but never started, less ``skip`` (the ones it is running).
        Otherwise also the entries placed on dead engines that they never read.
        """
        streams = self.streams()
        dead = set() if own else \
            {o for o in streams.values() if o} - self.alive({o for o in streams.values() if o})
        claimed = 0
        for stream, owner in streams.items():
            claimed += self._claim(stream, own=own, skip=skip)
            if owner in dead and owner != self.engine_id:
                claimed += self._adopt(stream, owner)
        if not own:
            for stream in streams:
                self.forget_dead_consumers(stream)
        return claimed

    def _claim(self, stream: str, *, own: bool, skip: Collection[Entry]) -> int:
        """Entries of ``stream`` that dead engines read (or, ``own``: this one) and never
        finished."""
        min_idle_ms = 0 if own else int(self.claim_min_idle_s * 1000)
        try:
            pending = self.client.xpending_range(
                stream, protocol.ENGINE_GROUP, min="-", max="+", count=_BATCH + len(skip),
                consumername=self.engine_id if own else None, idle=min_idle_ms or None)
        except redis.ResponseError as exc:  # an engine stream deleted meanwhile
            if "NOGROUP" not in str(exc):
                raise
            return 0
        if own:
            ids = [p["message_id"] for p in pending
                   if Entry(stream, p["message_id"]) not in skip]
        else:
            owners = {protocol.as_text(p["consumer"]) for p in pending} - {self.engine_id}
            alive = self.alive(owners)
            ids = [p["message_id"] for p in pending
                   if protocol.as_text(p["consumer"]) in owners - alive]
        if ids:
            claimed = self.client.xclaim(stream, protocol.ENGINE_GROUP, self.engine_id,
                                         min_idle_time=min_idle_ms, message_ids=ids)
            log.warning("engine %s claimed %d request(s) left by dead engines",
                        self.engine_id, len(claimed))
            for entry_id, fields in claimed:
                if fields:
                    self.take_over(Entry(stream, entry_id), fields)
                else:  # deleted from the stream while pending (Redis < 7 still lists it)
                    self.events.drop(Entry(stream, entry_id))
        return len(ids)

    def _adopt(self, stream: str, owner: str) -> int:
        """The entries placed on ``owner``, a dead engine, that it never read: run here as
        if placed here. Its stream goes once empty and quiet (no web tier places work on
        an engine whose heartbeat is stale, and this one's last entry is old)."""
        reply = self.client.xreadgroup(protocol.ENGINE_GROUP, self.engine_id, {stream: ">"},
                                       count=_BATCH)
        taken = 0
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                taken += 1
                request = self.intake.decode(Entry(stream, entry_id), fields)
                if request is not None:
                    self.intake.start(Entry(stream, entry_id), request)
        if taken:
            log.warning("engine %s took %d request(s) placed on dead engine %s",
                        self.engine_id, taken, owner)
        elif not self.client.xlen(stream) and self._quiet(stream):
            with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(stream)
                pipe.srem(self.registry, owner)
                pipe.execute()
        return taken

    def _quiet(self, stream: str) -> bool:
        try:
            last = protocol.as_text(self.client.xinfo_stream(stream)["last-generated-id"])
        except redis.ResponseError:  # gone already
            return True
        return time.time() * 1000 - int(last.partition("-")[0]) >= self.claim_min_idle_s * 1000

    def take_over(self, entry: Entry, fields: Any) -> None:
        request = self.intake.decode(entry, fields)
        if request is None:
            return
        raw = self.client.xrange(protocol.events_stream(self.model_name, request.request_id))
        if not raw:
            self.intake.start(entry, request)
            return
        try:
            events = [protocol.Event.decode(f) for _, f in raw]
        except Exception:  # noqa: BLE001 - a damaged stream is still a lost request
            log.warning("events of request %s do not decode", request.request_id)
            events = []
        if events and events[-1].is_final:
            self.events.drop(entry)
            return
        if events and all(e.type == protocol.EV_ACCEPTED for e in events):
            log.info("request %s: its engine died before its first token; running it here",
                     request.request_id)
            self.intake.start(entry, request, first_seq=events[-1].seq + 1)
            return
        made = sum(len(e.data.get("token_ids", [])) for e in events
                   if e.type == protocol.EV_DELTA)
        prompts = [request.prompt_token_ids, *request.extra_prompts]
        usage = Usage(prompt_tokens=sum(map(len, prompts)) if made else 0,
                      completion_tokens=made)
        seq = events[-1].seq + 1 if events else len(raw)
        self.events.write_final(entry, request.request_id, protocol.Event(
            seq, protocol.EV_ERROR, {"code": protocol.ERROR_ENGINE_LOST,
                                     "message": "the engine running this request stopped",
                                     "usage": usage.to_dict()}), request=request)

    def alive(self, engine_ids: set[str]) -> set[str]:
        """The engines among ``engine_ids`` whose last heartbeat is fresh."""
        ids = sorted(engine_ids)
        if not ids:
            return set()
        with self.client.pipeline(transaction=False) as pipe:
            for engine_id in ids:
                pipe.zscore(protocol.ENGINES_ZSET, engine_id)
            scores = pipe.execute()
        since = time.time() - protocol.HEARTBEAT_TTL_S
        return {e for e, s in zip(ids, scores, strict=True) if s is not None and s >= since}

    def forget_dead_consumers(self, stream: str) -> None:
        """Removes dead engines with nothing pending from the group, so it does not grow."""
        try:
            consumers = self.client.xinfo_consumers(stream, protocol.ENGINE_GROUP)
        except redis.ResponseError:  # an engine stream deleted meanwhile
            return
        idle_ms = self.claim_min_idle_s * 1000
        candidates = {protocol.as_text(c["name"]) for c in consumers
                      if not c["pending"] and c["idle"] >= idle_ms} - {self.engine_id}
        for name in candidates - self.alive(candidates):
            self.forget_consumer(stream, name)

    def forget_consumer(self, stream: str, name: str) -> None:
        pending = self.client.xpending_range(stream, protocol.ENGINE_GROUP, min="-",
                                             max="+", count=1, consumername=name)
        if not pending:
            self.client.xgroup_delconsumer(stream, protocol.ENGINE_GROUP, name)


