"""One engine worker's HTTP endpoint, on a port of its own: ``GET /metrics`` for
Prometheus, ``/livez`` and ``/readyz`` for the orchestrator's probes (docs/deploy.md)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.metrics import engine_registry

log = logging.getLogger(__name__)


def serve_metrics(latest: Callable[[], dict[str, Any] | None],
                  health: Callable[[], tuple[bool, bool]], *, port: int, model_name: str,
                  engine: str, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serves ``latest()`` (the engine's last heartbeat snapshot) and ``health()`` (live,
    ready) from a daemon thread."""
    registry = engine_registry(latest, model_name=model_name, engine=engine)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            path = self.path.split("?")[0]
            if path in ("/livez", "/readyz"):
                live, ready = health()
                ok = live if path == "/livez" else ready
                self._answer(200 if ok else 503, b"ok\n" if ok else b"not ready\n",
                             "text/plain; charset=utf-8")
            elif path != "/metrics":
                self.send_error(404)
            elif latest() is None:  # before the engine's first heartbeat
                self.send_error(503)
            else:
                self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("metrics: " + fmt, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    log.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
