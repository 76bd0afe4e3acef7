"""Moved to the shared top-level `redaction` package (the engine imports it without Django)."""

from redaction import DETECTORS, Detector, find, redact, tenant_detector

__all__ = ["DETECTORS", "Detector", "find", "redact", "tenant_detector"]
