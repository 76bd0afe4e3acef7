"""The Redis protocol between the platform and engine workers (docs/protocol.md).

Pure Python, no torch and no Django: both sides import this module and nothing
else of each other. Every payload is one JSON document in the field ``data`` of
a stream entry or in a plain key, so either side can be replaced by any
language that speaks Redis.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.wire_types import typed_fields

PROTOCOL_VERSION = 2  # 2: a model's keys carry its hash tag (model_prefix)
KEY_PREFIX = "atrium"

ENGINE_GROUP = "engines"
HEARTBEAT_INTERVAL_S = 1.0
# An engine whose last heartbeat is older than this is dead.
HEARTBEAT_TTL_S = 5.0
# Event streams and cancel flags outlive their request by this much, then expire.
EVENTS_TTL_S = 300
# An engine that cannot write a request's events to Redis for this long stops the request
# (error ``events_unavailable``) and generates nothing more until Redis answers again.
PUBLISH_GRACE_S = 1.0
REQUEST_STREAM_MAXLEN = 100_000


def model_prefix(model: str) -> str:
    """Where every key of one model's request path starts: its request streams, events,
    notices, cancels, usage and engines' markers. The hash tag ``{m:<model>}`` puts them in
    one Redis Cluster slot, so each MULTI an engine or the web tier sends (an events batch
    with its usage report and XACK, a cancel) is one slot's: Redis Cluster refuses a MULTI
    across slots (CROSSSLOT). A model is served from one shard; models spread over shards.
    NOTE: a model name holding ``}`` ends the tag early, the same way in every key of it."""
    return f"{KEY_PREFIX}:{{m:{model}}}"


def request_stream(model: str) -> str:
    """Stream of pending requests for one served model, read by a consumer group."""
    return f"{model_prefix(model)}:requests"


def engine_stream(model: str, engine_id: str) -> str:
    """Stream of the requests the web tier placed on one engine (inference/routing.py).
    Read by the same consumer group: the engine reads it first, and an idle engine of the
    model may take entries it has not read (work stealing); after the engine is gone, its
    peers' recovery takes what is left."""
    return f"{model_prefix(model)}:requests-for:{engine_id}"


def lane_stream(model: str, lane: str) -> str:
    """A model's stream for a service tiers' lane (LANES), read by every engine of the model:
    the priority lane first and beyond an engine's room; the spare lane (flex, batch lines)
    with a room of its own, so spare work never takes the room default requests wait in."""
    return f"{model_prefix(model)}:requests-{lane}"


LANE_PRIORITY, LANE_SPARE = "priority", "spare"
LANES = (LANE_PRIORITY, LANE_SPARE)


def lane_of(tier: str) -> str | None:
    """The lane a request of ``tier`` is queued in; None: placed like any other."""
    if tier == TIER_PRIORITY:
        return LANE_PRIORITY
    return LANE_SPARE if tier in SPARE_TIERS else None


def tiers_of_lane(lane: str) -> frozenset[str]:
    return frozenset(t for t in TIERS if lane_of(t) == lane)


def engine_streams_key(model: str) -> str:
    """The set of the model's engine streams (``engine_stream``): where recovery looks for
    what a dead engine left."""
    return f"{model_prefix(model)}:engine-streams"


def events_stream(model: str, request_id: str) -> str:
    """Stream of one request's events, written by the engine that runs it."""
    return f"{model_prefix(model)}:events:{request_id}"


def notify_stream(model: str, reader_id: str) -> str:
    """Stream of one events reader (a web process's) for one model: each entry's field
    names are the ids of requests whose events streams were written to; what it reads
    next."""
    return f"{model_prefix(model)}:notify:{reader_id}"


NOTIFY_STREAM_MAXLEN = 10_000
TRACEPARENT_MAX = 128  # a W3C traceparent is 55 characters


def cancel_key(model: str, request_id: str) -> str:
    """Exists while a request is cancelled; an engine checks it when it takes the request."""
    return f"{model_prefix(model)}:cancel:{request_id}"


def cancels_stream(model: str) -> str:
    """Ids of the model's requests cancelled, newest last; its engines read it every step."""
    return f"{model_prefix(model)}:cancels"


CANCELS_STREAM_MAXLEN = 10_000


def queue_cancel(pipe: Any, model: str, request_id: str) -> None:
    """Queues a request's cancel on ``pipe`` (a MULTI, so both land or neither): the key an
    engine that has not taken the request yet finds when it does, and the entry the engine
    running it reads before its next step."""
    pipe.set(cancel_key(model, request_id), b"1", ex=EVENTS_TTL_S)
    pipe.xadd(cancels_stream(model), {"request_id": request_id},
              maxlen=CANCELS_STREAM_MAXLEN, approximate=True)


def usage_stream(model: str) -> str:
    """Usage of every request the model's engines accepted, for the billing ledger
    (consumer group "billing"); written in the MULTI that settles the request."""
    return f"{model_prefix(model)}:usage"


# The set of every usage stream an engine has written to: what billing reads.
USAGE_STREAMS_KEY = f"{KEY_PREFIX}:usage-streams"
USAGE_GROUP = "billing"
USAGE_STREAM_MAXLEN = 1_000_000
# Adapter lifecycle news for engines: entries {"type": "deleted", "adapter_hash"}.
ADAPTER_EVENTS_STREAM = f"{KEY_PREFIX}:adapter-events"
ADAPTER_EVENTS_MAXLEN = 10_000
ENGINES_ZSET = f"{KEY_PREFIX}:engines"  # member engine_id, score last heartbeat (unix s)


def engine_key(engine_id: str) -> str:
    """The engine's latest heartbeat document (EngineHeartbeat as JSON)."""
    return f"{KEY_PREFIX}:engine:{engine_id}"


def live_heartbeats(client: Any, now: float) -> list[bytes]:
    """The heartbeat documents of the engines alive at ``now`` (unix s), on a synchronous
    redis-py client. NOTE: one GET each in a pipeline, not an MGET: on Redis Cluster the
    engines' keys lie in different slots, and a pipeline sends each to its shard."""
    ids = client.zrangebyscore(ENGINES_ZSET, now - HEARTBEAT_TTL_S, "+inf")
    if not ids:
        return []
    with client.pipeline(transaction=False) as pipe:
        for engine_id in ids:
            pipe.get(engine_key(as_text(engine_id)))
        return [doc for doc in pipe.execute() if doc]


def usage_streams(client: Any) -> list[str]:
    """Every stream usage is reported on (a synchronous client): each model's."""
    return sorted(as_text(s) for s in client.smembers(USAGE_STREAMS_KEY))


async def live_heartbeats_async(client: Any, now: float) -> list[bytes]:
    """``live_heartbeats`` on an asyncio client."""
    ids = await client.zrangebyscore(ENGINES_ZSET, now - HEARTBEAT_TTL_S, "+inf")
    if not ids:
        return []
    async with client.pipeline(transaction=False) as pipe:
        for engine_id in ids:
            pipe.get(engine_key(as_text(engine_id)))
        return [doc for doc in await pipe.execute() if doc]


def engine_writes_key(model: str, engine_id: str) -> str:
    """The number of the engine's last batch of event writes Redis applied (engine-private;
    in the model's slot, as every batch it marks)."""
    return f"{model_prefix(model)}:engine-writes:{engine_id}"


@dataclass(slots=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id (as text) -> bias
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    # None: no logprobs; k >= 0: the sampled token's and the k most likely (at most 20).
    logprobs: int | None = None
    # None: none; k >= 0 (at most 20): each prompt token's after the first (vLLM's
    # prompt_logprobs): its logprob, its rank and the k most likely at its position.
    prompt_logprobs: int | None = None
    # Structured output: {"type": "json_object"} or {"type": "json_schema", "schema": {...}}.
    grammar: dict[str, Any] | None = None
    # Choices to generate from each prompt (1..16); with more than one choice in all
    # (n * prompts > 1) deltas carry "index" and the finish event "choices".
    n: int = 1


# Several prompts in one request (OpenAI completions with a list of prompts): at most
# this many after ``prompt_token_ids``, and at most MAX_CHOICES choices (n per prompt).
MAX_EXTRA_PROMPTS = 15
MAX_CHOICES = 64

# What a request asks of the engine (EngineRequest.task).
TASK_GENERATE = "generate"  # text from each prompt: deltas, then the final event
# One vector per input (``prompt_token_ids``, then each of ``extra_prompts``): no delta, and
# the final event carries them ("embeddings"); the sampling spec is not read.
TASK_EMBED = "embed"
TASKS = (TASK_GENERATE, TASK_EMBED)
MAX_EMBED_INPUTS = 255  # an embed request's inputs after ``prompt_token_ids`` (256 in all)
MAX_FAIR_WEIGHT = 1000.0
MAX_CACHE_RETENTION_S = 7 * 24 * 3600.0
MAX_RESIDENT_ADAPTERS = 100_000
# Tenants a heartbeat's placement names in "fair", at most (the most served first).
FAIR_STANDING_MAX = 64


def max_extra_prompts(task: str) -> int:
    """How many ``extra_prompts`` a request of ``task`` may have."""
    return MAX_EMBED_INPUTS if task == TASK_EMBED else MAX_EXTRA_PROMPTS


# Service tiers (docs/tiers.md), in the order the scheduler serves them: "priority" ahead
# of "default", then the spare-capacity tiers, which run only on what those two leave and
# are preempted first: "flex" (OpenAI's, at a lower price) and "batch" (the Batch API's
# lines). Within a tier the plan's ``priority`` orders, then token-fair service.
TIER_PRIORITY = "priority"
TIER_DEFAULT = "default"
TIER_FLEX = "flex"
TIER_BATCH = "batch"
TIERS = (TIER_PRIORITY, TIER_DEFAULT, TIER_FLEX, TIER_BATCH)
SPARE_TIERS = frozenset((TIER_FLEX, TIER_BATCH))

# An earlier web tier's batch lines came as this priority with no tier: still the batch tier.
BATCH_PRIORITY = 100


def tier_of(request: EngineRequest) -> str:
    """The tier ``request`` runs in (an earlier web tier named batch lines by priority)."""
    if request.service_tier == TIER_DEFAULT and request.priority >= BATCH_PRIORITY:
        return TIER_BATCH
    return request.service_tier


@dataclass(slots=True)
class EngineRequest:
    """One generation request, as XADDed to ``request_stream(model)``."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    tenant_id: str
    # Derived on the server from tenant, model and adapter identity; never from the client.
    cache_salt: str = ""
    adapter: str | None = None  # the adapter's name, for accounting and logs
    # The adapter's content hash: what the engine loads from the adapter store, and part
    # of the prefix-cache scope. Set by the platform with ``adapter``.
    adapter_hash: str | None = None
    api_key_id: int | None = None  # for the usage ledger; never an access decision here
    # The request's ``user`` (the tenant's end user), for the ledger and its budgets.
    user: str | None = None
    # The ledger's key for its usage when not ``request_id``: a batch line's, billed once.
    usage_id: str | None = None
    price_class: str = "interactive"  # "batch", "embedding": the price book's class it bills at
    priority: int = 0  # the plan's class within its tier; lower runs first
    deadline: float | None = None  # unix seconds; past it the engine stops with "deadline"
    service_tier: str = TIER_DEFAULT  # one of TIERS
    fair_weight: float = 1.0  # the plan's weight in token-fair scheduling (fair_share.py)
    cache_retention_s: float = 0.0  # its cached blocks kept ahead of others (host_kv.py)
    # Of its tenant's adapters, at most this many in the engine's device slots at once (the
    # plan's; 0: no limit but the tenant's fair share of them, engine/lora/shares.py).
    max_resident_adapters: int = 0
    # Unix seconds: a request not yet started by then ends with FINISH_QUEUE_TIMEOUT, having
    # used nothing (flex: the client's timeout).
    queue_deadline: float | None = None
    arrival: float = field(default_factory=time.time)
    version: int = PROTOCOL_VERSION
    # Prompts 1..P-1, each run like ``prompt_token_ids`` (prompt 0); prompt p's sample i is
    # choice p * n + i.
    extra_prompts: list[list[int]] = field(default_factory=list)
    # ``notify_stream`` of the reader waiting for its events: each write names the request
    # there, so the reader reads only streams with news. None: it polls.
    notify: str | None = None
    # The W3C traceparent of the web tier's span, when tracing is on (observability.md).
    traceparent: str | None = None
    # TASK_GENERATE or TASK_EMBED (absent in an earlier version's message: generate). An
    # embed request's inputs are ``prompt_token_ids`` then each of ``extra_prompts`` (at most
    # MAX_EMBED_INPUTS of those); ``sampling`` is not read (the platform sends max_tokens 1).
    task: str = TASK_GENERATE

    def encode(self) -> dict[str, str]:
        doc = asdict(self)
        if not self.max_resident_adapters:
            # NOTE: left out at its default, so an engine of the release before it (which
            # refuses fields it does not know) serves tenants without a cap while a fleet rolls.
            del doc["max_resident_adapters"]
        return {"data": json.dumps(doc, separators=(",", ":"))}

    @property
    def num_choices(self) -> int:
        """Choices in all: n for each prompt."""
        return (1 + len(self.extra_prompts)) * self.sampling.n

    @classmethod
    def decode(cls, fields: dict[Any, Any]) -> EngineRequest:
        """Raises ValueError, naming the field, when the entry is not a well-typed request."""
        raw = json.loads(as_text(fields[b"data"] if b"data" in fields else fields["data"]))
        if not isinstance(raw, dict):
            raise ValueError("the request must be a JSON object")
        raw["sampling"] = SamplingSpec(**typed_fields(SamplingSpec, raw.get("sampling"),
                                                      "sampling"))
        request = cls(**typed_fields(cls, raw, "request"))
        # NOTE: the model's own notify stream, nothing else: the engine writes it in the
        # MULTI of the request's events, which must stay in the model's slot.
        if request.notify is not None and \
                not request.notify.startswith(notify_stream(request.model, "")):
            raise ValueError("request.notify must name a stream "
                             f"{notify_stream(request.model, '…')}")
        if request.traceparent is not None and len(request.traceparent) > TRACEPARENT_MAX:
            raise ValueError(f"request.traceparent is longer than {TRACEPARENT_MAX} characters")
        if request.task not in TASKS:
            raise ValueError(f"request.task must be one of {', '.join(TASKS)}")
        if request.service_tier not in TIERS:
            raise ValueError(f"request.service_tier must be one of {', '.join(TIERS)}")
        if not 0 < request.fair_weight <= MAX_FAIR_WEIGHT:
            raise ValueError(f"request.fair_weight must be above 0 and at most {MAX_FAIR_WEIGHT}")
        if not 0 <= request.cache_retention_s <= MAX_CACHE_RETENTION_S:
            raise ValueError("request.cache_retention_s must be from 0 to "
                             f"{MAX_CACHE_RETENTION_S}")
        if not 0 <= request.max_resident_adapters <= MAX_RESIDENT_ADAPTERS:
            raise ValueError("request.max_resident_adapters must be from 0 to "
                             f"{MAX_RESIDENT_ADAPTERS}")
        return request


# Event types on ``events_stream(model, request_id)``; every entry carries a ``seq``
# that starts at 0 and grows by one, so a reader can tell a gap from a delay.
EV_ACCEPTED = "accepted"  # data: {"engine_id"}
# data: {"text", "token_ids"}, and with logprobs asked for, "logprobs": one
# [logprob, [[token_id, logprob], ...]] per token (the sampled token's, then the top k);
# with more than one choice (num_choices > 1), "index": the choice (absent: 0). With
# prompt_logprobs asked for, once, on the first delta of each prompt's choice p * n:
# "prompt_logprobs", one [logprob, rank, [[token_id, logprob], ...]] per prompt token after
# the first (rank: 1 + the tokens more likely there; the top k most likely first); such a
# delta may carry no text and no token ids.
EV_DELTA = "delta"
# data: {"finish_reason", "usage": {...}}, and with more than one choice, "choices": one
# {"index", "finish_reason", "cumulative_logprob"} per choice; always the last event.
# An embed request's (TASK_EMBED, which has no delta) that finished "stop" also carries
# "embeddings": one string per input, in input order, each the base64 of its vector as
# little-endian float32 (OpenAI's encoding_format "base64"); its usage counts every input's
# tokens as prompt_tokens, completion_tokens 0.
EV_FINISH = "finish"
EV_ERROR = "error"  # data: {"code", "message", "usage"}; always the last event

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_DEADLINE = "deadline"
# It waited past its queue_deadline without starting: nothing ran, nothing is billed.
FINISH_QUEUE_TIMEOUT = "queue_timeout"

# The ``code`` of an EV_ERROR event.
ERROR_INVALID_REQUEST = "invalid_request"  # malformed entry or a request the engine refuses
ERROR_ENGINE = "engine_error"  # the engine failed while running this request
ERROR_ENGINE_LOST = "engine_lost"  # its engine died; another engine closed the stream
ERROR_ENGINE_SHUTDOWN = "engine_shutdown"  # its engine was stopped before it finished
# Its engine could not write its events to Redis for PUBLISH_GRACE_S and stopped it; the
# final event (with the usage of what was made) is written once Redis answers again.
ERROR_EVENTS_UNAVAILABLE = "events_unavailable"


@dataclass(slots=True)
class Event:
    seq: int
    type: str
    data: dict[str, Any]

    def encode(self) -> dict[str, str]:
        return {
            "seq": str(self.seq),
            "type": self.type,
            "data": json.dumps(self.data, separators=(",", ":")),
        }

    @classmethod
    def decode(cls, fields: dict[Any, Any]) -> Event:
        get = lambda k: as_text(fields[k.encode()] if k.encode() in fields else fields[k])  # noqa: E731
        return cls(seq=int(get("seq")), type=get("type"), data=json.loads(get("data")))

    @property
    def is_final(self) -> bool:
        return self.type in (EV_FINISH, EV_ERROR)


@dataclass(slots=True)
class EngineHeartbeat:
    engine_id: str
    model: str
    started_at: float
    sent_at: float
    running: int = 0
    waiting: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    draining: bool = False  # stopping: it takes no new request (engine/worker.py, drain)
    version: int = PROTOCOL_VERSION
    # Entries in its ``engine_stream`` it has not read yet (they wait for room here, and
    # an idle peer may take them).
    queued: int = 0
    # What requests are placed by (inference/routing.py): {"stream": true (it reads its
    # ``engine_stream``), "prefix": a PrefixSummary as a dict, "adapters": content hashes in
    # host memory, "kv_usage": 0..1, "seats": requests it holds at most, running and
    # waiting, "lanes": true (it reads the tiers' lanes), "fair": {tenant: how far ahead of
    # the least-served waiting tenant, in weighted tokens} for the tenants most ahead}; without
    # "stream" (an earlier version) requests reach it on the shared stream.
    placement: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> EngineHeartbeat:
        # NOTE: fields a newer engine adds are left out, so a fleet upgrades one process at
        # a time (docs/deploy.md, "Upgrades").
        known = {f.name for f in dataclasses.fields(cls)}
        beat = cls(**{k: v for k, v in json.loads(as_text(raw)).items() if k in known})
        if not isinstance(beat.placement, dict):
            beat.placement = {}
        return beat


def as_text(value: str | bytes) -> str:
    """A Redis reply's string, whether the client decodes replies or not."""
    return value.decode() if isinstance(value, bytes) else value


@dataclass(slots=True)
class UsageReport:
    """One accepted request's final usage, XADDed to its model's ``usage_stream`` with its
    final event."""

    request_id: str
    tenant_id: str
    model: str
    usage: dict[str, Any]
    occurred_at: float  # unix seconds when the request ended
    api_key_id: int | None = None
    adapter: str | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    version: int = PROTOCOL_VERSION
    user: str | None = None  # the request's end user, as EngineRequest.user
    price_class: str = "interactive"  # as EngineRequest.price_class

    def encode(self) -> dict[str, str]:
        return {"data": json.dumps(asdict(self), separators=(",", ":"))}

    @classmethod
    def decode(cls, fields: dict[Any, Any]) -> UsageReport:
        return cls(**json.loads(as_text(fields[b"data"] if b"data" in fields else fields["data"])))
