"""The platform's live-server fixtures, for the adapter tests."""

from tests.platform.conftest import (  # noqa: F401
    adapter_store,
    api_server,
    redis_client,
    served_model,
)
