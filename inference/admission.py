"""Quota admission: one atomic Redis script per request, at the tenant and the key level.

`admit` runs admit.lua: requests/min and tokens/min (GCRA buckets; a request
reserves prompt + max_tokens), concurrent requests (a sorted set of in-flight
request ids scored by lease expiry, so a crashed web process cannot hold slots
past its lease), the monthly token cap, and the budgets (billing/budget_counters.py: the
request's largest possible cost is reserved in every budget window that applies).
Every web process shares the same keys, so limits hold however many processes run.
`settle` runs settle.lua once the request ends however it ends: it frees the slot,
gives back the tokens reserved but not used, and turns each budget reservation into
what the request cost.

Keys (all under ``atrium:quota:{t<tenant id>}:``, the hash tag keeping one tenant's keys
in one Redis Cluster slot; ``t:`` the tenant's, ``k<key id>:`` a key's): ``rpm`` and
``tpm`` (string, TAT in unix ms), ``inflight`` (sorted set), ``tokens:{YYYY-MM}``
(integer, UTC month).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
import redis.asyncio as aioredis

from billing import (
    budget_counters,
    spend_counters,  # Redis keys and values only; no Django
)
from billing.money import from_micros, to_cents
from core.errors import QuotaExceeded, RateLimited, ServiceUnavailable
from core.metrics import ADMISSION_REJECTIONS
from inference.errors import TooLargeForRateLimit
from inference.scripts import ADMIT, SETTLE
from tenants.principals import Principal  # the facade's dataclass; importable without Django

# Seconds after a request's deadline that its in-flight slot is kept if never released.
LEASE_SLACK_S = 30

REASON_CONCURRENCY, REASON_RPM, REASON_TPM, REASON_MONTH, REASON_TOO_LARGE = 1, 2, 3, 4, 5
REASON_BUDGET_SPEND, REASON_BUDGET_TOKENS = 6, 7
# The reasons as the metrics name them (atrium_admission_rejections_total{reason}).
_REASONS = {REASON_CONCURRENCY: "concurrency", REASON_RPM: "requests_per_minute",
            REASON_TPM: "tokens_per_minute", REASON_MONTH: "monthly_tokens",
            REASON_TOO_LARGE: "too_large", REASON_BUDGET_SPEND: "budget_spend",
            REASON_BUDGET_TOKENS: "budget_tokens"}
_LEVELS = {1: "tenant", 2: "key"}


# How long a month's token counter is kept after the month ends (admit.lua sets the same).
MONTH_COUNTER_GRACE_MS = 7 * 86_400_000


def quota_key(tenant_id: int, name: str, *, api_key_id: int | None = None) -> str:
    """A tenant's (or, given ``api_key_id``, one of its keys') admission counter."""
    level = "t" if api_key_id is None else f"k{api_key_id}"
    return f"atrium:quota:{{t{tenant_id}}}:{level}:{name}"


def bucket_in_use(tat: str | bytes | None, now_ms: int, per_minute: int | None) -> int | None:
    """How much of a per-minute limit a GCRA bucket (admit.lua) has in use now: the units it
    would take to drain its theoretical arrival time back to `now`. None when unlimited."""
    if not per_minute:
        return None
    ahead_ms = max(float(tat) - now_ms, 0.0) if tat is not None else 0.0
    return min(math.ceil(ahead_ms * per_minute / 60_000 - 1e-9), per_minute)


def month_window(now: float | None = None) -> tuple[str, int]:
    """The UTC month's label (YYYY-MM) and when it ends, in unix ms."""
    moment = datetime.fromtimestamp(now if now is not None else time.time(), UTC)
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    reset = datetime(year, month, 1, tzinfo=UTC)
    return f"{moment.year:04d}-{moment.month:02d}", int(reset.timestamp() * 1000)


def usage_snapshot(client: redis.Redis, *, tenant_id: int, requests_per_minute: int | None,
                   tokens_per_minute: int | None) -> dict[str, int | None]:
    """What a tenant has in use now by admission's own counters, read at Redis's clock:
    the per-minute buckets, requests in flight and this month's tokens, by quota name."""
    month, _ = month_window()
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    with client.pipeline(transaction=False) as pipe:
        pipe.get(quota_key(tenant_id, "rpm"))
        pipe.get(quota_key(tenant_id, "tpm"))
        pipe.zcount(quota_key(tenant_id, "inflight"), now_ms, "+inf")
        pipe.get(quota_key(tenant_id, f"tokens:{month}"))
        rpm_tat, tpm_tat, inflight, month_tokens = pipe.execute()
    return {"requests_per_minute": bucket_in_use(rpm_tat, now_ms, requests_per_minute),
            "tokens_per_minute": bucket_in_use(tpm_tat, now_ms, tokens_per_minute),
            "max_concurrent_requests": int(inflight or 0),
            "monthly_token_cap": int(month_tokens or 0)}


def format_duration(ms: int) -> str:
    """OpenAI's style for x-ratelimit-reset-*: 20ms, 1.5s, 6m0s."""
    ms = max(0, int(ms))
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


@dataclass(frozen=True, slots=True)
class RateLimitState:
    """The binding (lowest remaining) of the tenant's and the key's buckets."""

    limit_requests: int
    remaining_requests: int
    reset_requests_ms: int
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_ms: int

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.limit_requests >= 0:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            out["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_ms)
        if self.limit_tokens >= 0:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            out["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_ms)
        return out


@dataclass(frozen=True, slots=True)
class BudgetWindow:
    """One budget window that applied to a request, as admission left it."""

    slot: int  # 0..5: (tenant, key, end user) x (day, month), budget_counters.SLOT_NAMES
    budget_id: int
    spend_limit_micros: int | None
    spend_used_micros: int  # spent + reserved, this request's reservation included
    token_limit: int | None
    tokens_used: int
    resets_ms: int

    @property
    def name(self) -> str:
        scope, window = budget_counters.SLOT_NAMES[self.slot]
        return f"{scope}/{window}"

    def share_left(self) -> float:
        """The smaller of what is left of the spend and of the tokens, as a fraction."""
        shares = [1 - used / limit if limit else 0.0
                  for limit, used in ((self.spend_limit_micros, self.spend_used_micros),
                                      (self.token_limit, self.tokens_used))
                  if limit is not None]
        return min(shares, default=1.0)


def _budget_windows(reply: list[int], slots: budget_counters.Slots) -> list[BudgetWindow]:
    out = []
    for slot in range(6):
        budget_id, spend, spent, tokens, used = reply[11 + slot * 5: 16 + slot * 5]
        if budget_id:
            out.append(BudgetWindow(slot, budget_id, None if spend < 0 else spend,
                                    max(spent, 0), None if tokens < 0 else tokens,
                                    max(used, 0), slots.resets_ms[slot]))
    return out


def money(amount_micros: int) -> str:
    """An amount for people: exact, with at least the cents shown."""
    text = format(from_micros(amount_micros).normalize(), "f")
    whole, _, fraction = text.partition(".")
    return f"{whole}.{fraction.ljust(2, '0')}"


def budgets_visible(principal: Principal) -> bool:
    """Whether the caller may read its tenant's budgets (a key with the billing scope, as
    the budgets API asks): only then do its answers say where budgets stand."""
    return principal.has_scope("billing")


def budget_headers(windows: list[BudgetWindow], principal: Principal) -> dict[str, str]:
    """The binding budget (least left) in ``x-budget-*`` headers (docs/billing.md), for a
    caller that may read budgets."""
    if not windows or not budgets_visible(principal):
        return {}
    binding = min(windows, key=BudgetWindow.share_left)
    reset = datetime.fromtimestamp(binding.resets_ms / 1000, UTC)
    out = {"x-budget-scope": binding.name,
           "x-budget-reset": reset.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if binding.spend_limit_micros is not None:
        out["x-budget-limit-spend"] = money(binding.spend_limit_micros)
        out["x-budget-remaining-spend"] = money(
            max(binding.spend_limit_micros - binding.spend_used_micros, 0))
    if binding.token_limit is not None:
        out["x-budget-limit-tokens"] = str(binding.token_limit)
        out["x-budget-remaining-tokens"] = str(max(binding.token_limit - binding.tokens_used,
                                                   0))
    return out


@dataclass(slots=True)
class Admission:
    """An admitted request's hold on its quotas, released by `settle` exactly once."""

    principal: Principal
    request_id: str
    reserved_tokens: int
    month: str
    state: RateLimitState
    budget_slots: budget_counters.Slots  # the windows as admitted, settled the same
    budget_windows: list[BudgetWindow] = field(default_factory=list)
    end_user: str | None = None
    settled: bool = field(default=False)

    def headers(self) -> dict[str, str]:
        return {**self.state.headers(),
                **budget_headers(self.budget_windows, self.principal)}

    def encode(self) -> dict[str, Any]:
        """What settling it takes, for another process (a resumable request's owner)."""
        slots = self.budget_slots
        return {"request_id": self.request_id, "reserved_tokens": self.reserved_tokens,
                "month": self.month, "end_user": self.end_user,
                "slots": [slots.keys, slots.fields, slots.user_defaults, slots.resets_ms]}

    @classmethod
    def decode(cls, data: dict[str, Any], principal: Principal) -> Admission:
        """The hold ``encode`` described; its rate-limit state (headers) is not kept."""
        return cls(principal=principal, request_id=data["request_id"],
                   reserved_tokens=int(data["reserved_tokens"]), month=data["month"],
                   state=RateLimitState(-1, -1, 0, -1, -1, 0),
                   budget_slots=budget_counters.Slots(*data["slots"]),
                   end_user=data.get("end_user"))


def _level_keys(principal: Principal, month: str) -> tuple[list[str], list[str]]:
    names = ("rpm", "tpm", "inflight", f"tokens:{month}")
    tenant = [quota_key(principal.tenant_id, n) for n in names]
    key = [quota_key(principal.tenant_id, n, api_key_id=principal.key_lineage) for n in names]
    return tenant, key


def _limits(principal: Principal, field: str) -> list[int]:
    """Each level's limit ``field`` (0: none): the tenant's, then the key's."""
    return [getattr(limits, field) or 0
            for limits in (principal.tenant_limits, principal.key_limits)]


async def _run(client: aioredis.Redis, sha: str, source: str, keys: list[str],
               args: list) -> list[int]:
    try:
        try:
            return await client.evalsha(sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return await client.eval(source, len(keys), *keys, *args)
    except redis.RedisError as exc:
        raise ServiceUnavailable("quota admission is unavailable right now; retry shortly"
                                 ) from exc


async def spend_cap_check(client: aioredis.Redis, principal: Principal) -> None:
    """Refuses the request (429 insufficient_quota) once the tenant's spend this month has
    reached its monthly spend cap (docs/billing.md).

    Billing keeps the cap and the month's committed spend in Redis (billing/spend_counters.py):
    one MGET, no database. Requests already in flight when the cap is reached still
    finish, so spend can pass the cap by their cost. The monthly *token* cap is the
    admission script's.
    """
    month, reset_ms = month_window()
    try:
        state = await spend_counters.cap_state(client, tenant_id=principal.tenant_id,
                                              month=month)
    except redis.RedisError as exc:
        raise ServiceUnavailable("quota admission is unavailable right now; retry shortly"
                                 ) from exc
    if state is None or not state.reached:
        return
    ADMISSION_REJECTIONS.labels("spend_cap", "tenant").inc()
    wait_ms = max(0, reset_ms - int(time.time() * 1000))
    cap = to_cents(from_micros(state.cap_micros))
    spent = to_cents(from_micros(state.spent_micros))
    raise QuotaExceeded(
        f"You reached the monthly spend cap of tenant '{principal.tenant_slug}' ({cap} "
        f"{state.currency}; {spent} {state.currency} spent this month). It resets in "
        f"{format_duration(wait_ms)}.",
        headers={"x-should-retry": "false", "retry-after": str(max(1, math.ceil(
            wait_ms / 1000)))})


def _script_args(principal: Principal, *, request_id: str, cost: int, cost_micros: int,
                 lease_ms: int, probe: bool, slots: budget_counters.Slots,
                 end_user: str | None, holds_slot: bool = True) -> tuple[list, list]:
    month, month_reset_ms = month_window()
    tenant_keys, key_keys = _level_keys(principal, month)
    levels = list(zip(tenant_keys, key_keys, strict=True))
    return ADMIT.build(
        rpm_keys=levels[0], tpm_keys=levels[1], inflight_keys=levels[2],
        month_keys=levels[3], budget_defs_key=budget_counters.defs_key(principal.tenant_id),
        budget_alerts_key=budget_counters.alerts_key(principal.tenant_id), window_keys=slots.keys,
        request_id=request_id, tokens=cost, lease_ms=lease_ms, month_reset_ms=month_reset_ms,
        rpm_limits=_limits(principal, "requests_per_minute"),
        tpm_limits=_limits(principal, "tokens_per_minute"),
        concurrency_limits=_limits(principal, "max_concurrent_requests") if holds_slot
        else [0, 0],
        month_caps=_limits(principal, "monthly_token_cap"), probe=int(probe),
        cost_micros=cost_micros, window_fields=slots.fields,
        end_user_fields=slots.user_defaults, window_resets=slots.resets_ms,
        end_user=end_user or "")


async def admit(client: aioredis.Redis, *, principal: Principal, request_id: str,
                prompt_tokens: int, max_tokens: int, lease_s: float,
                spend_checked: bool = False, cost_micros: int = 0,
                end_user: str | None = None, holds_slot: bool = True) -> Admission:
    """Takes the request's share of every limit and budget or none; raises RateLimited /
    QuotaExceeded (429, with Retry-After and the x-ratelimit-* headers) when one is reached.
    `cost_micros`: the request's largest possible cost, reserved in its budgets.
    `spend_checked`: the precheck just read the spend cap; it is not read again.
    `holds_slot` False: not refused at the concurrency limit (a request that makes no
    tokens and is settled at once, such as a tokenize)."""
    cost = prompt_tokens + max_tokens
    if not spend_checked:
        await spend_cap_check(client, principal)
    month, _ = month_window()
    slots = budget_counters.slots(tenant_id=principal.tenant_id, api_key_id=principal.key_lineage,
                          end_user=end_user)
    keys, args = _script_args(principal, request_id=request_id, cost=cost,
                              cost_micros=cost_micros, lease_ms=int(lease_s * 1000),
                              probe=False, slots=slots, end_user=end_user,
                              holds_slot=holds_slot)
    reply = [int(x) for x in await _run(client, ADMIT.sha, ADMIT.source, keys, args)]
    (ok, reason, level, retry_ms, failed_limit, rl, rr, rreset, tl, tr, treset) = reply[:11]
    state = RateLimitState(rl, rr, rreset, tl, tr, treset)
    windows = _budget_windows(reply, slots)
    if ok:
        return Admission(principal=principal, request_id=request_id, reserved_tokens=cost,
                         month=month, state=state, budget_slots=slots,
                         budget_windows=windows, end_user=end_user)
    raise _refusal(principal, reason=reason, level=level, retry_ms=retry_ms,
                   limit=failed_limit, cost=cost, state=state, windows=windows,
                   end_user=end_user)


async def precheck(client: aioredis.Redis, *, principal: Principal,
                   end_user: str | None = None) -> RateLimitState:
    """Refuses (429) at once a caller that no request could pass now (at its requests per
    minute, concurrency, monthly tokens, spend cap or a budget with nothing left), before
    its prompt is tokenized: a refused tenant cannot make the web tier parse megabytes.
    Takes nothing; returns the caller's rate-limit state, for the headers of an answer
    refused before admission."""
    await spend_cap_check(client, principal)
    slots = budget_counters.slots(tenant_id=principal.tenant_id, api_key_id=principal.key_lineage,
                          end_user=end_user)
    # One token and one micro-unit: the least any request costs.
    keys, args = _script_args(principal, request_id="", cost=1, cost_micros=1, lease_ms=0,
                              probe=True, slots=slots, end_user=end_user)
    reply = [int(x) for x in await _run(client, ADMIT.sha, ADMIT.source, keys, args)]
    (ok, reason, level, retry_ms, failed_limit, rl, rr, rreset, tl, tr, treset) = reply[:11]
    state = RateLimitState(rl, rr, rreset, tl, tr, treset)
    if not ok:
        raise _refusal(principal, reason=reason, level=level, retry_ms=retry_ms,
                       limit=failed_limit, cost=1, state=state,
                       windows=_budget_windows(reply, slots), end_user=end_user)
    return state


def _budget_refusal(principal: Principal, *, reason: int, slot: int, retry_ms: int,
                    windows: list[BudgetWindow], end_user: str | None,
                    headers: dict[str, str]) -> QuotaExceeded:
    scope, window = budget_counters.SLOT_NAMES[slot]
    owner = {"tenant": f"tenant '{principal.tenant_slug}'",
             "key": f"API key {principal.api_key_prefix}…",
             "user": f"end user '{end_user}'"}[scope]
    held = next((w for w in windows if w.slot == slot), None)
    if not budgets_visible(principal):
        held = None  # the figures are for those who may read budgets
    period = "daily" if window == "day" else "monthly"
    if reason == REASON_BUDGET_SPEND and held is not None:
        what = (f"{period} spend budget of {owner} ({money(held.spend_limit_micros or 0)}; "
                f"{money(held.spend_used_micros)} spent or reserved by requests in flight, "
                "and this request could cost more than what is left)")
    elif held is not None:
        what = (f"{period} token budget of {owner} ({held.token_limit} tokens; "
                f"{held.tokens_used} used or reserved, and this request could use more "
                "than what is left)")
    else:
        kind = "spend" if reason == REASON_BUDGET_SPEND else "token"
        what = f"{period} {kind} budget of {owner}"
    headers.update(budget_headers(windows, principal))
    headers["x-should-retry"] = "false"
    headers["retry-after"] = str(max(1, math.ceil(retry_ms / 1000)))
    return QuotaExceeded(f"You reached the {what}. It resets in {format_duration(retry_ms)}; "
                         "a smaller max_tokens may fit.", headers=headers)


def _refusal(principal: Principal, *, reason: int, level: int, retry_ms: int, limit: int,
             cost: int, state: RateLimitState, windows: list[BudgetWindow],
             end_user: str | None) -> RateLimited | QuotaExceeded:
    headers = state.headers()
    if reason in (REASON_BUDGET_SPEND, REASON_BUDGET_TOKENS):
        slot = level - 1
        ADMISSION_REJECTIONS.labels(_REASONS[reason], budget_counters.SLOT_NAMES[slot][0]).inc()
        return _budget_refusal(principal, reason=reason, slot=slot, retry_ms=retry_ms,
                               windows=windows, end_user=end_user, headers=headers)
    level = _LEVELS[level]
    ADMISSION_REJECTIONS.labels(_REASONS[reason], level).inc()
    owner = (f"tenant '{principal.tenant_slug}'" if level == "tenant"
             else f"API key {principal.api_key_prefix}…")
    if reason == REASON_TOO_LARGE:
        # Waiting cannot help: tell clients not to retry.
        headers["x-should-retry"] = "false"
        return TooLargeForRateLimit(
            f"Request too large for tokens per minute (TPM) of {owner}: limit {limit}, "
            f"requested {cost} (prompt + max_tokens), so waiting cannot admit it. Use a "
            "shorter prompt or a smaller max_tokens.", type="tokens", headers=headers)
    retry_s = retry_ms / 1000
    headers["retry-after"] = str(max(1, math.ceil(retry_s)))
    headers["retry-after-ms"] = str(max(1, retry_ms))
    wait = format_duration(retry_ms)
    if reason == REASON_MONTH:
        headers["x-should-retry"] = "false"
        return QuotaExceeded(f"You exceeded the monthly token quota of {owner} ({limit} "
                             f"tokens). It resets in {wait}.", headers=headers)
    what, kind = {REASON_CONCURRENCY: ("concurrent requests", "requests"),
                  REASON_RPM: ("requests per minute (RPM)", "requests"),
                  REASON_TPM: ("tokens per minute (TPM)", "tokens")}[reason]
    return RateLimited(f"Rate limit reached for {what} of {owner}: limit {limit}. "
                       f"Please try again in {wait}.", type=kind, headers=headers)


async def settle(client: aioredis.Redis, admission: Admission, *, used_tokens: int,
                 cost_micros: int = 0) -> bool:
    """Frees the slot, gives back reserved-but-unused tokens, and counts what the request
    cost (`cost_micros`, `used_tokens`) in the budget windows it held; True if this call
    freed the slot."""
    if admission.settled:
        return False
    principal = admission.principal
    tenant_keys, key_keys = _level_keys(principal, admission.month)
    levels = list(zip(tenant_keys, key_keys, strict=True))
    slots = admission.budget_slots
    used = max(0, used_tokens)
    keys, args = SETTLE.build(
        tpm_keys=levels[1], inflight_keys=levels[2], month_keys=levels[3],
        budget_defs_key=budget_counters.defs_key(principal.tenant_id),
        budget_alerts_key=budget_counters.alerts_key(principal.tenant_id),
        window_keys=slots.keys, request_id=admission.request_id,
        refund=max(0, admission.reserved_tokens - used),
        tpm_limits=_limits(principal, "tokens_per_minute"), cost_micros=max(0, cost_micros),
        used=used, end_user=admission.end_user or "", window_fields=slots.fields,
        end_user_fields=slots.user_defaults)
    # NOTE: marked settled only once the script ran: a call that failed (Redis away) can
    # be made again, and the script refunds once however often it runs.
    done = bool(await _run(client, SETTLE.sha, SETTLE.source, keys, args))
    admission.settled = True
    return done
