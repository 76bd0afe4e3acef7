"""The public landing page and the health check."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from webui.selectors import engine_heartbeats


def index(request: HttpRequest) -> HttpResponse:
    from core.served_models import served_models

    engines = engine_heartbeats()
    # Engine ids and queue depths are the operator's business; others learn if any is up.
    return render(request, "webui/index.html", {
        "engines": engines if request.user.is_staff else [], "alive": len(engines),
        "models": list(served_models())})


def healthz(request: HttpRequest) -> HttpResponse:
    try:
        engines = len(engine_heartbeats())
    except Exception:  # noqa: BLE001 - health reports, never raises
        return JsonResponse({"status": "degraded", "redis": False}, status=503)
    return JsonResponse({"status": "ok", "redis": True, "engines": engines})
