"""The live-server fixtures (tests/live.py): real Redis, the real ASGI app, engines."""

from tests.live import (  # noqa: F401
    api_server,
    engine_worker,
    redis_client,
    served_model,
    tenant_key,
)
