"""The lanes background work runs in: which Celery queue each task goes to, and how the
worker that serves a lane runs (`atrium worker --lane NAME`; docs/deploy.md#lanes).

What a tenant can slow down (its webhook endpoint, its mail, its exports, its uploads, its
batches) never shares a worker with usage ingest and the spend counters, which every
tenant's bill and budgets wait on. Inside a lane, each tenant's share is capped where the
work is claimed (core/lanes.py, the webhook and batch claims).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    "alerts": ("billing.tasks.budget_alerts", "billing.tasks.budget_alert_email"),
    "webhooks": ("billing.tasks.webhook_deliver", "billing.tasks.webhooks_due"),
    "exports": ("billing.tasks.export_build",),
    "adapters": ("adapters.tasks.adapter_validate",),
    "batches": ("inference.tasks.batch_run",),
}.items() for name in names}
