"""A Prometheus endpoint for one engine worker: ``GET /metrics`` on a port of its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine.metrics import render_prometheus

log = logging.getLogger(__name__)


def serve_metrics(latest: Callable[[], dict[str, Any] | None], *, port: int,
                  labels: dict[str, str], host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serves ``latest()`` (the engine's last heartbeat snapshot) from a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            snapshot = latest()
            if self.path.split("?")[0] != "/metrics" or snapshot is None:
                self.send_error(404 if snapshot is not None else 503)
                return
            body = render_prometheus(snapshot, labels).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("metrics: " + fmt, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    log.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
