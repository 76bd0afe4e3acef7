"""What other apps may use of adapters: plain dataclasses and functions, never models."""

from __future__ import annotations

from adapters.naming import ModelRef, model_id, parse_model
from adapters.selectors import AdapterNotFound, ServedAdapter, adapter_list_usable, adapter_resolve
from adapters.selectors import AdapterNotReady as AdapterUnavailable

__all__ = [
    "AdapterNotFound", "AdapterUnavailable", "ModelRef", "ServedAdapter", "adapter_list_usable",
    "adapter_resolve", "model_id", "parse_model",
]
