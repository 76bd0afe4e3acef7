"""Writes of files and batches, one module per concern: files (uploads checked as a
stream, expiry), batches (made and cancelled by their owner), running (what the batch
runner, inference/batch_runner.py, calls), and the tenant's limits. The names other code
uses are re-exported here; every tenant-owned read and write takes the tenant's id.
Other apps use batches/facade.py."""

from __future__ import annotations

from batches.services.batches import (
    BATCH_RUN,
    WINDOWS,
    batch_cancel,
    batch_create,
    batch_get,
    batch_run_enqueue,
)
from batches.services.files import (
    EXPIRES_AFTER_S,
    PURPOSES,
    file_content,
    file_create,
    file_delete,
    file_get,
    files_expire,
)
from batches.services.limits import ACTIVE
from batches.services.running import (
    batch_claim,
    batch_expand,
    batch_fail,
    batch_finalize,
    batch_heartbeat,
    batches_resume,
    batches_waiting_enqueue,
    line_attempted,
    line_record,
    lines_fail_pending,
    lines_pending,
)

__all__ = [
    "ACTIVE", "BATCH_RUN", "EXPIRES_AFTER_S", "PURPOSES", "WINDOWS", "batch_cancel",
    "batch_claim", "batch_create", "batch_expand", "batch_fail", "batch_finalize",
    "batch_get", "batch_heartbeat", "batch_run_enqueue", "batches_resume",
    "batches_waiting_enqueue", "file_content", "file_create", "file_delete", "file_get",
    "files_expire", "line_attempted", "line_record", "lines_fail_pending", "lines_pending",
]
