"""The request streams one engine reads (docs/protocol.md, "Placement").

Its own stream first (what the web tier placed on it), with the model's shared
stream beside it (what was placed on no engine, or handed back by one that
drains); before both, the model's priority lane, and after them its spare lane
(the service tiers' lanes, protocol.LANES), each read up to a room of its own.
When all are empty and it has room, it takes entries a busy peer has not read
yet (work stealing): a peer leaves entries unread only while its own queue is
full, so nothing waits behind a hot replica while another is idle. All of a
model's streams are read by one consumer group, so an entry goes to exactly one
engine however many read its stream.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from engine import protocol
from engine.events import Entry, EventWriter

log = logging.getLogger(__name__)

_HAND_BACK = 1000  # entries handed back per read when draining


class RequestStreams:
    def __init__(self, client: redis.Redis, *, model_name: str, engine_id: str) -> None:
        self.client = client
        self.engine_id = engine_id
        self.model_name = model_name
        self.own = protocol.engine_stream(model_name, engine_id)
        self.shared = protocol.request_stream(model_name)
        self.lanes = {lane: protocol.lane_stream(model_name, lane) for lane in protocol.LANES}
        self.registry = protocol.engine_streams_key(model_name)
        # The model's other live engines -> (entries queued unread in their streams, when
        # that heartbeat was sent), as last read (``see_peers``).
        self.peers: dict[str, tuple[int, float]] = {}
        # Peer -> the heartbeat (its sent_at, the peer's own clock: no skew between hosts)
        # this engine last took from it by: a heartbeat's news is acted on once.
        self._acted_on: dict[str, float] = {}
        self.stolen = 0  # entries taken from peers' streams

    def ensure_groups(self) -> None:
        for stream in (self.own, self.shared, *self.lanes.values()):
            try:
                self.client.xgroup_create(stream, protocol.ENGINE_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def register(self) -> None:
        """Lists the own stream for recovery (once its group exists and it heartbeats)."""
        self.client.sadd(self.registry, self.engine_id)

    def read(self, room: int, block_ms: int | None, *, lanes: dict[str, int] | None = None,
             also: tuple[str, bytes | str, int] | None = None
             ) -> tuple[list[tuple[Entry, Any]], Any]:
        """Up to about ``room`` new entries placed here or shared, and up to each lane's
        room of its lane's (``lanes``: lane -> room); when there are none, entries stolen
        from a busy peer; else, ``block_ms`` given, whatever arrives within it.

        ``also`` (stream, last id, count): that stream's newer entries (XREAD's reply), read
        in the same round trip as the first read: the second of what every step reads."""
        lanes = lanes or {}
        reads = [({self.lanes[protocol.LANE_PRIORITY]: ">"},
                  lanes.get(protocol.LANE_PRIORITY, 0)),
                 ({self.own: ">", self.shared: ">"}, room),
                 ({self.lanes[protocol.LANE_SPARE]: ">"}, lanes.get(protocol.LANE_SPARE, 0))]
        reads = [(streams, count) for streams, count in reads if count > 0]
        with self.client.pipeline(transaction=False) as pipe:
            for streams, count in reads:
                pipe.xreadgroup(protocol.ENGINE_GROUP, self.engine_id, streams, count=count)
            if also is not None:
                pipe.xread({also[0]: also[1]}, count=also[2])
            replies = pipe.execute() if reads or also is not None else []
        other = replies[-1] if also is not None else None
        entries = [e for reply in replies[:len(reads)] for e in self._entries(reply)]
        if not entries and room > 0:
            entries = self.steal(room)
        if not entries and block_ms and reads:
            every = {stream: ">" for streams, _ in reads for stream in streams}
            entries = self._read(every, max(count for _, count in reads), block_ms)
        return entries, other

    def steal(self, room: int) -> list[tuple[Entry, Any]]:
        """Entries the busiest peer has not read, up to half its queue (so the two end up
        even) and ``room``; from each peer once per heartbeat of it."""
        for peer, (queued, sent_at) in sorted(self.peers.items(), key=lambda p: -p[1][0]):
            if queued <= 0:
                break
            if self._acted_on.get(peer, float("-inf")) >= sent_at:
                continue
            self._acted_on[peer] = sent_at
            count = min(room, max(1, queued // 2))
            try:
                entries = self._read({protocol.engine_stream(self.model_name, peer): ">"}, count,
                                     None)
            except redis.ResponseError as exc:  # the peer's stream went meanwhile
                if "NOGROUP" not in str(exc):
                    raise
                continue
            if entries:
                self.stolen += len(entries)
                log.info("engine %s took %d queued request(s) from busy engine %s",
                         self.engine_id, len(entries), peer)
                return entries
        return []

    def see_peers(self) -> None:
        """Reads the model's other engines' heartbeats: what their streams hold unread."""
        beats = [protocol.EngineHeartbeat.decode(d)
                 for d in protocol.live_heartbeats(self.client, time.time())]
        self.peers = {b.engine_id: (b.queued, b.sent_at) for b in beats
                      if b.model == self.model_name and b.engine_id != self.engine_id
                      and not b.draining}
        self._acted_on = {p: t for p, t in self._acted_on.items() if p in self.peers}

    def queued(self) -> int:
        """Entries placed here and not read yet."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.xlen(self.own)
            pipe.xpending(self.own, protocol.ENGINE_GROUP)
            length, pending = pipe.execute(raise_on_error=False)
        if isinstance(length, Exception) or isinstance(pending, Exception):
            return 0
        return max(0, int(length) - int(pending["pending"]))

    def hand_back(self, events: EventWriter) -> int:
        """Moves what was placed here and not read to the shared stream, for the model's
        other engines (this one drains)."""
        moved = 0
        while entries := self._read({self.own: ">"}, _HAND_BACK, None):
            for entry, fields in entries:
                events.move(entry, fields, self.shared)
            moved += len(entries)
        if moved:
            log.info("engine %s handed %d queued request(s) back to %s", self.engine_id,
                     moved, self.shared)
        return moved

    def _read(self, streams: dict[str, str], count: int,
              block_ms: int | None) -> list[tuple[Entry, Any]]:
        return self._entries(self.client.xreadgroup(protocol.ENGINE_GROUP, self.engine_id,
                                                    streams, count=count, block=block_ms))

    @staticmethod
    def _entries(reply: Any) -> list[tuple[Entry, Any]]:
        return [(Entry(protocol.as_text(stream), entry_id), fields)
                for stream, entries in reply or [] for entry_id, fields in entries]


