"""The engine's metrics endpoint listens on loopback unless an operator says otherwise."""

from __future__ import annotations

import argparse

from engine.metrics_server import serve_metrics
from engine.worker import add_engine_arguments


def _flags(monkeypatch, **env: str) -> argparse.Namespace:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args([])


def test_metrics_listen_on_loopback_by_default(monkeypatch):
    monkeypatch.delenv("ATRIUM_METRICS_HOST", raising=False)
    assert _flags(monkeypatch).metrics_host == "127.0.0.1"
    server = serve_metrics(lambda: None, port=0, labels={})
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()


def test_an_operator_may_open_metrics_to_other_hosts(monkeypatch):
    assert _flags(monkeypatch, ATRIUM_METRICS_HOST="0.0.0.0").metrics_host == "0.0.0.0"
