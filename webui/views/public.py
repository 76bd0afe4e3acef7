"""The public landing page and the health probes."""

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


def livez(request: HttpRequest) -> HttpResponse:
    """The process is up and answering: nothing else is checked (a liveness probe)."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> HttpResponse:
    """Ready to serve: the database and Redis answer, and each served model has an engine
    alive (a readiness probe; `atrium up` waits on it). 503, saying what is missing, if not."""
    from django.db import connection

    from core.served_models import served_models

    checks: dict[str, object] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = True
    except Exception:  # noqa: BLE001 - a probe reports, never raises
        checks["database"] = False
    try:
        beats = engine_heartbeats()
        checks["redis"] = True
    except Exception:  # noqa: BLE001
        beats, checks["redis"] = [], False
    # An engine that drains takes no new request: it does not make its model ready.
    engines = {name: sum(b.model == name and not b.draining for b in beats)
               for name in served_models()}
    checks["engines"] = engines
    ready = checks["database"] and checks["redis"] and all(engines.values())
    return JsonResponse({"status": "ready" if ready else "unavailable", **checks},
                        status=200 if ready else 503)
