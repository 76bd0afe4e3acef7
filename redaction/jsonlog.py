"""Structured (JSON) log lines, every one passed through redaction.

Used as the formatter of every handler in settings.LOGGING (web, Celery) and by
the engine workers (`configure_logging`, no Django), so nothing a library logs
(a request path with a key in it, an exception message quoting a prompt)
reaches the output unredacted.

What stays readable is decided by the detectors, never by who logged a line: a
loopback or "any" address (127.0.0.0/8, ::1, 0.0.0.0, ::) names no one, so the
server's own lines keep their URLs (``Uvicorn running on http://127.0.0.1:8000``,
``Prometheus metrics on http://127.0.0.1:9100/metrics``), while every other
address, and every secret or personal datum, is redacted in the message, its
arguments, its extra fields and its traceback alike. Exempting a logger or a
message template instead would leak the day someone logs an f-string.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

from redaction import redact

# Attributes every LogRecord has; anything else was passed through `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
# uvicorn's copy of a message with terminal colours (and its %s left in): noise in JSON.
_DROPPED = {"color_message"}
_SECRET_FIELDS = {"authorization", "proxy-authorization", "api_key", "x-api-key", "key",
                  "password", "secret", "prompt", "messages", "completion", "cookie",
                  "set-cookie", "token"}


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: "[REDACTED]" if str(k).lower() in _SECRET_FIELDS else _clean(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, int | float | bool) or value is None:
        return value
    return redact(str(value))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and name not in _DROPPED and not name.startswith("_"):
                line[name] = "[REDACTED]" if name.lower() in _SECRET_FIELDS else _clean(value)
        if record.exc_info:
            line["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str | int = "INFO", stream: IO[str] | None = None) -> None:
    """For processes without Django (the engine worker): every line JSON and redacted."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
