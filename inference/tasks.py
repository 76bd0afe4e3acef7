from __future__ import annotations

import asyncio
import time
from datetime import UTC, date, datetime

from celery import shared_task

from batches import facade as batch_facade
from batches.tasknames import BATCH_RUN
from billing.facade import tokens_used_between
from core.redis import sync_client
from engine import protocol
from inference import admission as quota
from inference import tasknames
from tenants.facade import api_key_lineages

RECONCILE_BATCH = 500  # counters per script call
# Raises a counter to the ledger's figure, never lowers it: above the ledger it holds the
# reservations of requests still running and usage not yet ingested.
_AT_LEAST = """
local expire_at = tonumber(ARGV[1])
local raised = 0
for i, key in ipairs(KEYS) do
  local target = tonumber(ARGV[i + 1])
  if tonumber(redis.call('GET', key) or '0') < target then
    redis.call('SET', key, target, 'PXAT', expire_at)
    raised = raised + 1
  end
end
return raised
"""


@shared_task(name=tasknames.ENGINES_PRUNE)
def engines_prune() -> int:
    """Drops engines whose heartbeat stopped from the liveness set; returns how many."""
    cutoff = time.time() - 10 * protocol.HEARTBEAT_TTL_S
    return sync_client().zremrangebyscore(protocol.ENGINES_ZSET, "-inf", cutoff)


@shared_task(name=tasknames.QUOTA_RECONCILE)
def quota_reconcile() -> int:
    """Rebuilds this month's token counters from the ledger where Redis lost them (a
    restart without persistence, a flush): each tenant's and key's counter is raised to
    at least what the ledger holds. Returns how many counters were raised."""
    month, reset_ms = quota.month_window()
    start = date.fromisoformat(f"{month}-01")
    end = datetime.fromtimestamp(reset_ms / 1000, UTC).date()
    by_tenant, by_key = tokens_used_between(start=start, end=end)
    script = sync_client().register_script(_AT_LEAST)
    expire_at = reset_ms + quota.MONTH_COUNTER_GRACE_MS
    name = f"tokens:{month}"
    # NOTE: one call per tenant: a tenant's keys share its Cluster slot, other tenants' not.
    by_tenant_keys: dict[int, list[tuple[str, int]]] = {}
    for tenant_id, tokens in by_tenant.items():
        by_tenant_keys.setdefault(tenant_id, []).append((quota.quota_key(tenant_id, name),
                                                         tokens))
    # A key's counter is its lineage's (tenants.Principal.key_lineage): rotations add up.
    lineages = api_key_lineages(key_id for _, key_id in by_key)
    by_lineage: dict[tuple[int, int], int] = {}
    for (tenant_id, key_id), tokens in by_key.items():
        lineage = (tenant_id, lineages.get(key_id, key_id))
        by_lineage[lineage] = by_lineage.get(lineage, 0) + tokens
    for (tenant_id, lineage), tokens in by_lineage.items():
        by_tenant_keys.setdefault(tenant_id, []).append(
            (quota.quota_key(tenant_id, name, api_key_id=lineage), tokens))
    raised = 0
    for targets in by_tenant_keys.values():
        for i in range(0, len(targets), RECONCILE_BATCH):
            batch = targets[i:i + RECONCILE_BATCH]
            raised += script(keys=[k for k, _ in batch],
                             args=[expire_at, *(t for _, t in batch)])
    return raised


@shared_task(name=BATCH_RUN, acks_late=True)
def batch_run(batch_id: str) -> str:
    """Runs a batch's pending lines (on the ``batches`` queue: a batch runs for minutes or
    hours and must not hold up the ledger's tasks)."""
    from inference.batch_runner import run_batch

    return asyncio.run(run_batch(batch_id))


@shared_task(name=tasknames.BATCHES_RESUME)
def batches_resume() -> int:
    """Starts a runner for each active batch whose runner died."""
    return batch_facade.batches_resume()
