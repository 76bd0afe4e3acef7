from __future__ import annotations

import time

import pytest

# The live-server fixtures are shared with the platform's tests.
from tests.live import (  # noqa: F401
    api_server,
    redis_client,
    served_model,
    start_engine,
    tenant_key,
)
from tests.requestlogs.echo_engine import echo_factory


@pytest.fixture
def echo_engine(served_model, tiny_model_path, redis_client):  # noqa: F811
    running = start_engine(tiny_model_path, served_model, "echo-engine",
                           engine_factory=echo_factory)
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


def wait_for_logs(count: int, timeout: float = 15.0, **filters):
    """The request logs once `count` of them (matching filters) are written; they are
    written in the background after the response."""
    from requestlogs.models import RequestLog

    deadline = time.time() + timeout
    while True:
        logs = list(RequestLog.objects.filter(**filters).order_by("id"))
        if len(logs) >= count or time.time() > deadline:
            assert len(logs) >= count, f"{len(logs)} request logs written, expected {count}"
            return logs
        time.sleep(0.05)
