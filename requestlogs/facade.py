"""What other apps may use of request logs: a plain dataclass in, a function to write it;
and the Responses API's stored responses.

The inference API builds a `RequestLogEntry` when a request ends and calls
`request_log_record_many` off the event loop, in batches (inference/requestlog.py). A
stored response (`stored_responses_write` of `ResponseWrite`s, in batches;
`stored_response_get`, `_cancel`, `_delete`; `NotStored`; `MAX_DEPTH` responses chained at
most; the `RUNNING` states) is redacted like a log's bodies
(requestlogs/stored_responses.py).
"""

from __future__ import annotations

from requestlogs.services import RequestLogEntry, request_log_record_many
from requestlogs.stored_responses import (
    MAX_DEPTH,
    RUNNING,
    NotStored,
    ResponseWrite,
    StoredResponseInfo,
    stored_response_cancel,
    stored_response_delete,
    stored_response_get,
    stored_responses_write,
)

__all__ = ["MAX_DEPTH", "RUNNING", "NotStored", "RequestLogEntry", "ResponseWrite",
           "StoredResponseInfo", "request_log_record_many", "stored_response_cancel",
           "stored_response_delete", "stored_response_get", "stored_responses_write"]
