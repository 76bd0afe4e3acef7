"""Budgets in Redis: what admission reserves against, read and written by one script.

A budget limits spend (micro-units) and/or tokens (prompt + completion) per UTC day or
month, for a tenant, one of its API keys, or an end user of its app (the request's
``user``). Billing publishes the definitions here (`defs_set`); admission (admit.lua)
reserves each request's largest possible cost against every budget that applies, and
settlement (settle.lua) replaces the reservation with what the request cost. The
ledger stays the truth: a periodic task raises each counter to the ledger's figure
(`counters_raise`) where Redis lost an increment.

Every key of one tenant carries the hash tag ``{t<tenant id>}``, as the quota keys do,
so one script's keys share a Redis Cluster slot:

- ``atrium:budget:{t1}:defs``: hash, field ``<scope>:<subject>:<window>`` →
  ``"<budget id> <spend limit micros|-1> <token limit|-1>"``. Scopes ``t`` (subject
  ``-``), ``k`` (the key's id), ``u`` (a digest of the user, or ``*``: each end user
  without a budget of their own).
- ``atrium:budget:{t1}:<scope>:<subject>:<window label>``: hash of one budget's window:
  ``s``/``t`` spent micros and tokens (settled), ``rs``/``rt`` reserved by requests in
  flight, ``a`` the highest alert threshold reached (50, 80, 100).
- ``atrium:budget:{t1}:holds`` (request id → its reservation and the windows it holds)
  and ``...:leases`` (request ids by when their reservation lapses if never settled).
- ``atrium:budget:{t1}:alerts``: set of thresholds crossed, waiting for the worker.

No Django here: the inference hot path imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import redis

PREFIX = "atrium:budget"
SCOPES = {"tenant": "t", "key": "k", "user": "u"}
WINDOWS = ("day", "month")
# A window's counters outlive it by this much, for whoever reads them late.
COUNTER_GRACE_MS = 7 * 86_400_000
EACH_USER = "*"


def tag(tenant_id: int) -> str:
    return f"{{t{tenant_id}}}"


def defs_key(tenant_id: int) -> str:
    return f"{PREFIX}:{tag(tenant_id)}:defs"


def alerts_key(tenant_id: int) -> str:
    return f"{PREFIX}:{tag(tenant_id)}:alerts"


def user_subject(user: str) -> str:
    """An end user as budgets name them: a digest, so any string makes a short key."""
    return hashlib.sha256(user.encode()).hexdigest()[:24]


def subject_of(scope: str, *, api_key_id: int | None = None, end_user: str | None = None
               ) -> str:
    if scope == "tenant":
        return "-"
    if scope == "key":
        return str(api_key_id)
    return EACH_USER if not end_user else user_subject(end_user)


def field(scope: str, subject: str, window: str) -> str:
    return f"{SCOPES[scope]}:{subject}:{window}"


def window_bounds(window: str, now: datetime | None = None) -> tuple[str, datetime, datetime]:
    """The UTC day's or month's label, start and end around ``now``."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    if window == "day":
        start = datetime(moment.year, moment.month, moment.day, tzinfo=UTC)
        return start.strftime("%Y-%m-%d"), start, start + timedelta(days=1)
    start = datetime(moment.year, moment.month, 1, tzinfo=UTC)
    year, month = (start.year + 1, 1) if start.month == 12 else (start.year, start.month + 1)
    return start.strftime("%Y-%m"), start, datetime(year, month, 1, tzinfo=UTC)


def counter_key(tenant_id: int, scope_field: str, label: str) -> str:
    """One budget's counters for one window; ``scope_field`` less its window part."""
    return f"{PREFIX}:{tag(tenant_id)}:{scope_field}:{label}"


@dataclass(frozen=True, slots=True)
class Definition:
    budget_id: int
    spend_limit_micros: int | None
    token_limit: int | None

    def encode(self) -> str:
        spend = -1 if self.spend_limit_micros is None else self.spend_limit_micros
        tokens = -1 if self.token_limit is None else self.token_limit
        return f"{self.budget_id} {spend} {tokens}"


@dataclass(frozen=True, slots=True)
class Slots:
    """The budget windows one request may count against, in the order the scripts take
    them: (tenant, key, user) × (day, month). ``fields`` name each one's definition;
    ``user_defaults`` the each-end-user definitions, used where a user has none."""

    keys: list[str]
    fields: list[str]
    user_defaults: list[str]
    resets_ms: list[int]


def slots(*, tenant_id: int, api_key_id: int, end_user: str | None,
          now: datetime | None = None) -> Slots:
    keys, fields, defaults, resets = [], [], [], []
    subjects = [("tenant", "-"), ("key", str(api_key_id)),
                ("user", user_subject(end_user) if end_user else "")]
    for scope, subject in subjects:
        for window in WINDOWS:
            label, _, end = window_bounds(window, now)
            if subject:
                fields.append(field(scope, subject, window))
                keys.append(counter_key(tenant_id, f"{SCOPES[scope]}:{subject}", label))
            else:
                # No user on this request: a key no definition names, never written.
                fields.append("")
                keys.append(counter_key(tenant_id, "u:-", label))
            resets.append(int(end.timestamp() * 1000))
    defaults = ([field("user", EACH_USER, w) for w in WINDOWS] if end_user else ["", ""])
    return Slots(keys=keys, fields=fields, user_defaults=defaults, resets_ms=resets)


# The slots in script order, as (scope, window) for messages and headers.
SLOT_NAMES = [(scope, window) for scope in SCOPES for window in WINDOWS]


# Replaces a hash's fields with ARGV's (field, value) pairs, at once.
_REPLACE = """
redis.call('DEL', KEYS[1])
for i = 1, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return #ARGV / 2
"""


def defs_set(client: redis.Redis, definitions: Mapping[int, Mapping[str, Definition]],
             ) -> None:
    """Replaces each named tenant's definitions, each tenant's at once (an empty mapping:
    none). NOTE: one script call per tenant, not one MULTI for all: tenants' keys lie in
    different Redis Cluster slots."""
    script = client.register_script(_REPLACE)
    for tenant_id, by_field in definitions.items():
        script(keys=[defs_key(tenant_id)],
               args=[x for f, d in by_field.items() for x in (f, d.encode())])


@dataclass(frozen=True, slots=True)
class WindowState:
    spent_micros: int
    tokens: int
    reserved_micros: int
    reserved_tokens: int


def window_states(client: redis.Redis, keys: Iterable[str]) -> dict[str, WindowState]:
    keys = list(keys)
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hmget(key, "s", "t", "rs", "rt")
    out = {}
    for key, values in zip(keys, pipe.execute(), strict=True):
        s, t, rs, rt = (int(v or 0) for v in values)
        out[key] = WindowState(s, t, max(rs, 0), max(rt, 0))
    return out


# Raises a window's settled spend and tokens to at least the ledger's figures.
_RAISE = """
local raised = 0
for i, key in ipairs(KEYS) do
  local spend, tokens = tonumber(ARGV[i * 3 - 2]), tonumber(ARGV[i * 3 - 1])
  local expire_at = tonumber(ARGV[i * 3])
  local s = tonumber(redis.call('HGET', key, 's') or '0')
  local t = tonumber(redis.call('HGET', key, 't') or '0')
  if s < spend then redis.call('HSET', key, 's', spend); raised = raised + 1 end
  if t < tokens then redis.call('HSET', key, 't', tokens); raised = raised + 1 end
  redis.call('PEXPIREAT', key, expire_at)
end
return raised
"""


RAISE_PIPELINE = 500  # script calls sent in one round trip


def counters_raise(client: redis.Redis, figures: Mapping[str, tuple[int, int, int]]) -> int:
    """Raises each window (key → spend micros, tokens, its end in unix ms) to at least the
    ledger's figures; never lowers one. Returns how many values were raised. One call per
    key (keys of different tenants live in different Cluster slots), pipelined: a tenant
    with ten thousand end users costs twenty round trips, not ten thousand."""
    items = [(key, [spend, tokens, end_ms + COUNTER_GRACE_MS])
             for key, (spend, tokens, end_ms) in figures.items()]
    if isinstance(client, redis.RedisCluster):
        # NOTE: a cluster pipeline takes no scripts: one call per key.
        script = client.register_script(_RAISE)
        return sum(int(script(keys=[key], args=args)) for key, args in items)
    sha = client.script_load(_RAISE)
    raised = 0
    for i in range(0, len(items), RAISE_PIPELINE):
        pipe = client.pipeline(transaction=False)
        for key, args in items[i:i + RAISE_PIPELINE]:
            pipe.evalsha(sha, 1, key, *args)
        raised += sum(int(n) for n in pipe.execute())
    return raised


def alerts_pending(client: redis.Redis, tenant_id: int, *, limit: int) -> list[str]:
    """Up to ``limit`` of the tenant's crossed thresholds waiting for the worker."""
    return [v.decode() if isinstance(v, bytes) else v
            for v in client.srandmember(alerts_key(tenant_id), limit)]


def alerts_done(client: redis.Redis, tenant_id: int, entries: list[str]) -> None:
    if entries:
        client.srem(alerts_key(tenant_id), *entries)
