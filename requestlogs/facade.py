"""What other apps may use of request logs: a plain dataclass in, a function to write it.

The inference API builds a `RequestLogEntry` when a request ends and calls
`request_log_record_many` off the event loop, in batches (inference/requestlog.py).
"""

from __future__ import annotations

from requestlogs.services import RequestLogEntry, request_log_record_many

__all__ = ["RequestLogEntry", "request_log_record_many"]
