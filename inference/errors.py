"""The inference API's errors: the platform's one family (core.errors) plus its own."""

from __future__ import annotations

from core.errors import (
    ApiError,
    AuthenticationFailed,
    BodyTooLarge,
    InvalidRequest,
    PermissionDenied,
    QuotaExceeded,
    RateLimited,
    ServiceUnavailable,
)

__all__ = [
    "ApiError", "AuthenticationFailed", "InvalidRequest", "PermissionDenied", "QuotaExceeded",
    "RateLimited", "ServiceUnavailable", "ModelNotFound", "ContextLengthExceeded",
    "BodyTooLarge", "NoEngineAvailable", "EngineFailed", "DeadlineExceeded", "AdapterNotReady",
    "TooLargeForRateLimit", "ResourceUnavailable",
]


class ModelNotFound(ApiError):
    status = 404
    code = "model_not_found"


class AdapterNotReady(ApiError):
    """The caller's own adapter exists but is still validating, or failed validation."""

    status = 409
    code = "adapter_not_ready"


class ResourceUnavailable(RateLimited):
    """A flex request no engine started before its timeout (OpenAI's 429 for flex): it ran
    nothing and costs nothing."""

    code = "resource_unavailable"


class TooLargeForRateLimit(RateLimited):
    """A request larger than a per-minute token limit admits at all: a 429 as OpenAI
    answers it, but waiting cannot cure it (``x-should-retry: false``, no Retry-After), so
    a batch line fails at once instead of waiting for it."""


class ContextLengthExceeded(ApiError):
    status = 400
    code = "context_length_exceeded"


class NoEngineAvailable(ApiError):
    status = 503
    type = "server_error"
    code = "engine_unavailable"


class EngineFailed(ApiError):
    status = 502
    type = "server_error"
    code = "engine_error"


class DeadlineExceeded(ApiError):
    status = 504
    type = "server_error"
    code = "timeout"
