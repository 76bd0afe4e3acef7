from __future__ import annotations

import time

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from atrium.redis import sync_client
from engine import protocol


def _engines() -> list[protocol.EngineHeartbeat]:
    client = sync_client()
    ids = client.zrangebyscore(protocol.ENGINES_ZSET, time.time() - protocol.HEARTBEAT_TTL_S,
                               "+inf")
    docs = client.mget([protocol.engine_key(i.decode()) for i in ids]) if ids else []
    return [protocol.EngineHeartbeat.decode(d) for d in docs if d]


def index(request: HttpRequest) -> HttpResponse:
    from atrium.inference.served_models import served_models

    return render(request, "webui/index.html",
                  {"engines": _engines(), "models": list(served_models())})


def healthz(request: HttpRequest) -> HttpResponse:
    try:
        engines = len(_engines())
    except Exception:  # noqa: BLE001 - health reports, never raises
        return JsonResponse({"status": "degraded", "redis": False}, status=503)
    return JsonResponse({"status": "ok", "redis": True, "engines": engines})
