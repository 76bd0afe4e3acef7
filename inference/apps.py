from __future__ import annotations

from django.apps import AppConfig


class InferenceConfig(AppConfig):
    """The OpenAI-compatible API: routes, websocket, admission, dispatch, relay, settle."""

    name = "inference"
    verbose_name = "Inference API"
