"""The lanes background work runs in: which Celery queue each task goes to, and how the
worker that serves a lane runs (`atrium worker --lane NAME`; docs/deploy.md#lanes).

What a tenant can slow down (its webhook endpoint, its mail, its exports, its uploads, its
batches) never shares a worker with usage ingest and the spend counters, which every
tenant's bill and budgets wait on. Inside a lane, each tenant's share is capped where the
work is claimed (core/lanes.py, the webhook and batch claims).
"""

from __future__ import annotations

from dataclasses import dataclass

from adapters import queue as adapter_tasks
from batches import tasknames as batch_tasks
from billing import queue as billing_tasks


@dataclass(frozen=True, slots=True)
class Lane:
    queues: tuple[str, ...]
    pool: str  # Celery's pool: prefork for CPU work, threads for waiting on others' servers
    concurrency: int
    nice: int  # on a shared host, how far this lane's processes yield the CPU
    what: str


LANES = {
    "core": Lane(("celery",), "prefork", 1, 0,
                 "usage ingest, spend counters, budgets and quota reconciles, invoices, "
                 "housekeeping"),
    "outbound": Lane(("alerts", "webhooks"), "threads", 8, 0,
                     "budget alerts and their emails, webhook deliveries: waiting on "
                     "servers tenants name, each call under a deadline"),
    "jobs": Lane(("exports", "adapters"), "prefork", 2, 10,
                 "billing exports and adapter validation"),
    "batches": Lane(("batches",), "prefork", 2, 10,
                    "Batch API runners, each busy for the length of a batch"),
}
ALL_QUEUES = tuple(q for lane in LANES.values() for q in lane.queues)

# Task name -> its queue; a task not named here goes to "celery" (the core lane).
ROUTES = {name: {"queue": queue} for queue, names in {
    "alerts": (billing_tasks.BUDGET_ALERTS, billing_tasks.BUDGET_ALERT_EMAIL),
    "webhooks": (billing_tasks.WEBHOOK_DELIVER, billing_tasks.WEBHOOKS_DUE),
    "exports": (billing_tasks.EXPORT_BUILD,),
    "adapters": (adapter_tasks.ADAPTER_VALIDATE,),
    "batches": (batch_tasks.BATCH_RUN,),
}.items() for name in names}
