"""Moved to the shared `redaction.jsonlog` (the engine imports it without Django)."""

from redaction.jsonlog import JsonFormatter

__all__ = ["JsonFormatter"]
