"""A Prometheus endpoint for one engine worker: ``GET /metrics`` on a port of its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.metrics import engine_registry

log = logging.getLogger(__name__)


def serve_metrics(latest: Callable[[], dict[str, Any] | None], *, port: int, model_name: str,
                  engine: str, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serves ``latest()`` (the engine's last heartbeat snapshot) from a daemon thread."""
    registry = engine_registry(latest, model_name=model_name, engine=engine)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            if latest() is None:  # before the engine's first heartbeat
                self.send_error(503)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("metrics: " + fmt, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    log.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
