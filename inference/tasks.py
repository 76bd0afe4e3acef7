from __future__ import annotations

import time

from celery import shared_task

from core.redis import sync_client
from engine import protocol


@shared_task(name="inference.tasks.engines_prune")
def engines_prune() -> int:
    """Drops engines whose heartbeat stopped from the liveness set; returns how many."""
    cutoff = time.time() - 10 * protocol.HEARTBEAT_TTL_S
    return sync_client().zremrangebyscore(protocol.ENGINES_ZSET, "-inf", cutoff)
