"""What other apps may use of request logs: a plain dataclass in, a function to write it;
and the Responses API's stored responses.

The inference API builds a `RequestLogEntry` when a request ends and calls
`request_log_record_many` off the event loop, in batches (inference/requestlog.py). A
stored response (`stored_response_save`, `_get`, `_delete`; `retention_days` the
tenant's plan keeps them, 0: none; `NotStored`; `MAX_DEPTH` responses chained at most) is
redacted like a log's bodies (requestlogs/stored_responses.py).
"""

from __future__ import annotations

from requestlogs.services import RequestLogEntry, request_log_record_many
from requestlogs.stored_responses import (
    MAX_DEPTH,
    NotStored,
    StoredResponseInfo,
    retention_days,
    stored_response_delete,
    stored_response_get,
    stored_response_save,
)

__all__ = ["MAX_DEPTH", "NotStored", "RequestLogEntry", "StoredResponseInfo",
           "request_log_record_many", "retention_days", "stored_response_delete",
           "stored_response_get", "stored_response_save"]
