"""Placing a request on one of its model's engines (docs/protocol.md, "Placement").

Each engine's heartbeat says which prefix blocks it caches (a Bloom filter of their
keys, engine/prefix_hash.py), which adapters it holds in host memory, how full its
KV cache is and how much work it has. For each live engine this module estimates
what the request would cost there, in prompt tokens to compute:

- the prompt's blocks that engine does not cache (its keys chain the tenant's
  server-side cache scope, so only this tenant's own blocks ever count), by its
  summary or by what this process placed there since;
- a load from the adapter store when the adapter is neither in its memory nor on its way
  there (the heartbeat names both, and goes out as soon as a load begins);
- the requests ahead of it (waiting there, queued unread in its stream, and those
  this process sent it since its last heartbeat and has not seen start) and those
  running beside it;
- a conversation's own engine (an ``x-session-id`` header, ``prompt_cache_key`` or the
  ``user`` field, by rendezvous hashing over the live engines that hold its adapter, or
  over all where none does) costs less, so one conversation stays where its history is
  cached while that engine is not far busier.

The cheapest engine with a free seat gets the request on its own stream. When none has
one (each holds as many requests as it runs and queues, by its heartbeat and what this
process sent it since), the request goes to the model's shared stream, which the first
engine with room reads: the backlog there is what the fleet cannot hold, the signal
KEDA scales the engines on (docs/deploy.md). ``ATRIUM_ROUTING`` picks the policy:
``scored`` (this), ``random`` (any live engine, for comparison) or ``shared`` (the
model's one stream, which whichever engine reads first takes).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass

from core.metrics import ROUTING_ADAPTER_PLACEMENTS, ROUTING_PLACEMENTS
from engine import protocol
from engine.prefix_hash import PrefixSummary, cache_scope, prompt_keys

# What makes an engine slower to answer this request, in prompt tokens it would compute.
QUEUE_COST = 256  # each request ahead of it (waiting, queued, or just sent)
RUNNING_COST = 16  # each request running (its decodes share the steps)
ADAPTER_COST = 512  # the adapter is not in the engine's memory: a load from the store
KV_FULL_USAGE = 0.95  # past this the engine preempts to admit anything
KV_FULL_COST = 4096
SESSION_BONUS = 2048  # the conversation's own engine
# The tenant is ahead of its share on the engine (its token-fair counter, engine/fair_share.py):
# its request would wait there behind less-served tenants' work, about half its lead in
# tokens (an output token counts 2); capped, so a long lead does not outweigh everything.
FAIR_LEAD_COST_CAP = 4096
MAX_KEYS = 1024  # prompt blocks looked up at most (a 16k-token prefix at 16 per block)
SESSION_MAX = 256  # characters of a session hint
PLACED_KEYS = 8192  # prompt blocks remembered per engine (this process's placements)
SENT_FORGET_S = 60.0  # a placement never seen to start counts as load this long at most


@dataclass(frozen=True, slots=True)
class Placement:
    stream: str
    engine_id: str | None  # None: the model's shared stream
    cached_tokens: int = 0  # the prompt's tokens the engine is expected to have cached


class Router:
    """One process's placement over one model's engines; remembers what it sent each engine
    since that engine's last heartbeat and has not seen start yet, so a burst does not all
    go to the engine that looked idle."""

    def __init__(self) -> None:
        # Engine -> request id -> when this process placed it there, until its first token
        # (or its end) shows the engine took it up (``started``).
        self._sent: dict[str, dict[str, float]] = {}
        # Engine -> the prompt blocks this process placed there lately, newest last: a
        # burst sharing a prefix follows its first request before any heartbeat shows it.
        self._placed: dict[str, OrderedDict[bytes, None]] = {}
        # Engine -> (the heartbeat's sent_at, its prefix summary): decoded once per
        # heartbeat, not once per request.
        self._summaries: dict[str, tuple[float, PrefixSummary | None]] = {}

    def place(self, request: protocol.EngineRequest, beats: list[protocol.EngineHeartbeat],
              *, policy: str = "scored", session: str | None = None) -> Placement:
        lane = protocol.lane_of(request.service_tier)
        # NOTE: only once every engine of the model reads the lanes (an earlier version
        # does not): a priority or spare request goes to its lane, which every engine reads.
        if lane is not None and beats and all(b.placement.get("lanes") is True for b in beats):
            ROUTING_PLACEMENTS.labels(policy, "lane").inc()
            return Placement(protocol.lane_stream(request.model, lane), None)
        # NOTE: an engine of an earlier version reads only the model's shared stream.
        beats = [b for b in beats if b.placement.get("stream") is True]
        if policy == "shared" or not beats:
            ROUTING_PLACEMENTS.labels(policy, "shared").inc()
            return Placement(protocol.request_stream(request.model), None)
        if policy == "random":
            chosen, cached, reason = random.choice(beats), 0, "random"
        else:
            roomy = [b for b in beats if self._free(b) > 0]
            if not roomy:
                ROUTING_PLACEMENTS.labels(policy, "overflow").inc()
                return Placement(protocol.request_stream(request.model), None)
            chosen, cached, reason = self._score(request, roomy, session)
        self._sent.setdefault(chosen.engine_id, {})[request.request_id] = time.time()
        if len(self._sent) > 4 * len(beats):  # engines gone: forget them
            live = {b.engine_id for b in beats}
            self._sent = {e: sent for e, sent in self._sent.items() if e in live}
            self._placed = {e: keys for e, keys in self._placed.items() if e in live}
            self._summaries = {e: s for e, s in self._summaries.items() if e in live}
        ROUTING_PLACEMENTS.labels(policy, reason).inc()
        if request.adapter_hash:
            resident = request.adapter_hash in (chosen.placement.get("adapters") or ())
            ROUTING_ADAPTER_PLACEMENTS.labels(policy, "yes" if resident else "no").inc()
        return Placement(protocol.engine_stream(request.model, chosen.engine_id),
                         chosen.engine_id, cached)

    def _score(self, request: protocol.EngineRequest, beats: list[protocol.EngineHeartbeat],
               session: str | None) -> tuple[protocol.EngineHeartbeat, int, str]:
        scope = cache_scope(request.tenant_id, request.cache_salt,
                            request.adapter_hash or request.adapter)
        keys: dict[int, list[bytes]] = {}  # block size -> the prompt's keys
        home = _session_engine(request.tenant_id, session, _holding(request, beats)) \
            if session else None
        best: tuple[float, protocol.EngineHeartbeat, int, str] | None = None
        for beat in beats:
            cached = 0
            summary = self._summary(beat)
            if summary is not None:
                size = summary.block_size
                if size not in keys:
                    keys[size] = prompt_keys(request.prompt_token_ids, size, scope, MAX_KEYS)
                cached = max(summary.cached_blocks(keys[size]),
                             _leading(keys[size], self._placed.get(beat.engine_id))) * size
            cost = len(request.prompt_token_ids) - cached
            if request.adapter_hash and request.adapter_hash not in \
                    (beat.placement.get("adapters") or ()):
                cost += ADAPTER_COST
            cost += QUEUE_COST * (beat.waiting + beat.queued + self._sent_since(beat))
            cost += RUNNING_COST * beat.running
            cost += _lead(beat, request.tenant_id) / 2
            if float(beat.placement.get("kv_usage") or 0.0) >= KV_FULL_USAGE:
                cost += KV_FULL_COST
            reason = "prefix" if cached else "load"
            if beat.engine_id == home:
                cost -= SESSION_BONUS
                reason = "session"
            cost += random.random()  # even engines: spread, not always the first listed
            if best is None or cost < best[0]:
                best = (cost, beat, cached, reason)
        assert best is not None
        chosen = best[1]
        if (size := _block_size(chosen)) in keys:
            self._remember(chosen.engine_id, keys[size])
        return chosen, best[2], best[3]

    def _remember(self, engine_id: str, keys: list[bytes]) -> None:
        placed = self._placed.setdefault(engine_id, OrderedDict())
        for key in keys:
            placed[key] = None
            placed.move_to_end(key)
        while len(placed) > PLACED_KEYS:
            placed.popitem(last=False)

    def _free(self, beat: protocol.EngineHeartbeat) -> int:
        """Seats the engine has left (1 when it does not say how many it has)."""
        seats = beat.placement.get("seats")
        if not isinstance(seats, int):
            return 1
        return seats - beat.running - beat.waiting - beat.queued - self._sent_since(beat)

    def started(self, placement: Placement, request_id: str) -> None:
        """The request's engine made its first token (or ended it): it no longer waits."""
        if placement.engine_id is not None:
            self._sent.get(placement.engine_id, {}).pop(request_id, None)

    def _summary(self, beat: protocol.EngineHeartbeat) -> PrefixSummary | None:
        seen = self._summaries.get(beat.engine_id)
        if seen is None or seen[0] != beat.sent_at:
            seen = (beat.sent_at, PrefixSummary.from_dict(beat.placement.get("prefix")))
            self._summaries[beat.engine_id] = seen
        return seen[1]

    def _sent_since(self, beat: protocol.EngineHeartbeat) -> int:
        """Requests this process sent the engine after its heartbeat was written, and has
        not seen start (a request whose events were never read is forgotten after a
        while). The placements are in the order they were made: only the newest are
        counted and only the oldest forgotten, so this costs what was sent since."""
        sent = self._sent.get(beat.engine_id)
        if not sent:
            return 0
        forget = time.time() - SENT_FORGET_S
        while sent and (oldest := next(iter(sent.items())))[1] < forget:
            del sent[oldest[0]]
        count = 0
        for at in reversed(sent.values()):
            if at <= beat.sent_at:
                break
            count += 1
        return count


def _lead(beat: protocol.EngineHeartbeat, tenant: str) -> float:
    """How far the tenant is ahead of its share on the engine, as its heartbeat says."""
    fair = beat.placement.get("fair")
    lead = fair.get(tenant, 0) if isinstance(fair, dict) else 0
    if not isinstance(lead, int | float) or not math.isfinite(lead):
        return 0.0
    return min(max(float(lead), 0.0), FAIR_LEAD_COST_CAP)


def _block_size(beat: protocol.EngineHeartbeat) -> int | None:
    summary = beat.placement.get("prefix")
    return summary.get("block_size") if isinstance(summary, dict) else None


def _leading(keys: list[bytes], placed: OrderedDict[bytes, None] | None) -> int:
    """How many of the prompt's leading blocks this process placed on the engine lately."""
    if not placed:
        return 0
    for i, key in enumerate(keys):
        if key not in placed:
            return i
    return len(keys)


def _holding(request: protocol.EngineRequest, beats: list[protocol.EngineHeartbeat]
             ) -> list[protocol.EngineHeartbeat]:
    """The engines a conversation's home is chosen among: those holding its adapter in
    memory, where any does (a home that must load it would cost a load on every engine a
    tenant's conversations hash to); else all."""
    if not request.adapter_hash:
        return beats
    return [b for b in beats if request.adapter_hash in (b.placement.get("adapters") or ())] \
        or beats


def _session_engine(tenant_id: str, session: str,
                    beats: list[protocol.EngineHeartbeat]) -> str:
    """The conversation's engine: the highest of a hash of (tenant, session, engine) over
    the live engines, so every web process agrees without sharing state, and an engine
    joining or leaving moves only the conversations it takes or held."""
    def weight(engine_id: str) -> bytes:
        return hashlib.sha256(f"{tenant_id}\0{session}\0{engine_id}".encode()).digest()

    return max((b.engine_id for b in beats), key=weight)


_routers: dict[str, Router] = {}


def router(model: str) -> Router:
    """This process's placement for ``model``'s engines."""
    return _routers.setdefault(model, Router())
