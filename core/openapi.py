"""OpenAPI (drf-spectacular) conventions for the management API."""

from __future__ import annotations

import re

from drf_spectacular.openapi import AutoSchema


class OperationSchema(AutoSchema):
    """operationIds named after the operation class that handles the method:
    ApiKeyCreateApi.post is `api_key_create`, whatever view serves its URL."""

    def get_operation_id(self) -> str:
        handler = getattr(self.view, self.method.lower(), None)
        owner = getattr(handler, "__qualname__", "").split(".")[0]
        if owner.endswith("Api"):
            return re.sub(r"(?<!^)(?=[A-Z])", "_", owner.removesuffix("Api")).lower()
        return super().get_operation_id()
