"""Moved to the shared `redaction.detectors`."""

from redaction.detectors import *  # noqa: F403
from redaction.detectors import luhn_ok  # noqa: F401
