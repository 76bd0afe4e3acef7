"""Background work in lanes, and each tenant's share of a lane.

Celery queues are the lanes (the routes are in settings, the workers that serve them in
`atrium worker --lane`, docs/deploy.md#lanes): usage ingest and spend counters never
wait behind a webhook, an email, an export, an adapter's validation or a batch. Inside a
lane, :func:`tenant_slot` caps how much of it one tenant holds at once, across every
worker: a tenant with a hundred slow exports runs ``cap`` of them while other tenants'
exports run beside.

A slot is a member of one Redis sorted set per tenant and lane, scored by when it lapses:
a worker that dies holding one frees it after ``lease_s``, never holding the lane longer.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator

from core.redis import sync_client

PREFIX = "atrium:lane"
# The jobs lane's share (exports and adapter validations count together: the lane's few
# processes are never all one tenant's).
JOBS = "jobs"

# Takes a slot when fewer than ARGV[1] unexpired ones are held; ARGV: cap, now (ms),
# lapse (ms), member. Returns 1 when taken.
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2]
redis.call('PEXPIREAT', KEYS[1], last)
return 1
"""


class TenantBusy(Exception):
    """The tenant already holds its share of the lane: try again in ``retry_s``."""

    def __init__(self, lane: str, tenant_id: int, retry_s: float) -> None:
        super().__init__(f"tenant {tenant_id} holds its share of the {lane} lane")
        self.lane, self.tenant_id, self.retry_s = lane, tenant_id, retry_s


def slots_key(lane: str, tenant_id: int) -> str:
    # NOTE: the tenant's hash tag, as its quota keys carry (one Redis Cluster slot).
    return f"{PREFIX}:{{t{tenant_id}}}:{lane}"


@contextlib.contextmanager
def tenant_slot(lane: str, tenant_id: int, *, cap: int, lease_s: float,
                retry_s: float = 5.0) -> Iterator[None]:
    """Holds one of the tenant's ``cap`` slots in ``lane`` for the block; raises TenantBusy
    when all are held. ``lease_s`` bounds how long a dead holder keeps its slot: make it
    longer than the work can run."""
    client = sync_client()
    key = slots_key(lane, tenant_id)
    member = secrets.token_hex(8)
    now_ms = int(time.time() * 1000)
    taken = client.eval(_TAKE, 1, key, cap, now_ms, now_ms + int(lease_s * 1000), member)
    if not int(taken):
        raise TenantBusy(lane, tenant_id, retry_s)
    try:
        yield
    finally:
        client.zrem(key, member)


def slots_held(lane: str, tenant_id: int) -> int:
    """The tenant's unexpired slots in ``lane`` (for tests and the console)."""
    now_ms = int(time.time() * 1000)
    return sync_client().zcount(slots_key(lane, tenant_id), now_ms, "+inf")
