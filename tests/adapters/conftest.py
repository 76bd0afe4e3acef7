"""The live-server fixtures (tests/live.py): real Redis, the real ASGI app, engines."""

from tests.live import (  # noqa: F401
    adapter_store,
    api_server,
    celery_worker,
    engine_worker,
    redis_client,
    served_model,
    tenant_key,
)
