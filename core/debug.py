"""Django's DEBUG error page, with nothing on it that the logs would not show.

The page lists the request's GET and POST values, its headers, and every frame's local
variables (a request body among them): each passes through redaction here, as log lines
do, so a secret a developer's client sent is not echoed back on the page.
"""

from __future__ import annotations

from typing import Any

from django.views.debug import ExceptionReporter, SafeExceptionReporterFilter

from redaction import redact


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v) for v in value]
    if isinstance(value, int | float | bool) or value is None:
        return value
    return redact(repr(value))


class RedactingReporterFilter(SafeExceptionReporterFilter):
    def get_safe_request_meta(self, request: Any) -> dict[str, Any]:
        return {k: _redacted(v) for k, v in super().get_safe_request_meta(request).items()}

    def get_cleansed_multivaluedict(self, request: Any, multivaluedict: Any) -> Any:
        cleansed = super().get_cleansed_multivaluedict(request, multivaluedict).copy()
        for key in cleansed:
            cleansed.setlist(key, [_redacted(v) for v in cleansed.getlist(key)])
        return cleansed

    def get_post_parameters(self, request: Any) -> Any:
        params = super().get_post_parameters(request)
        if request is None or not hasattr(params, "setlist"):
            return params
        return self.get_cleansed_multivaluedict(request, params)

    def get_traceback_frame_variables(self, request: Any, tb_frame: Any) -> list:
        return [(name, _redacted(value))
                for name, value in super().get_traceback_frame_variables(request, tb_frame)]


class RedactingReporter(ExceptionReporter):
    """The page's query string, address and exception message, redacted."""

    def get_traceback_data(self) -> dict[str, Any]:
        data = super().get_traceback_data()
        if "request_GET_items" in data:
            data["request_GET_items"] = [(redact(k), redact(v))
                                         for k, v in data["request_GET_items"]]
        for name in ("request_insecure_uri", "exception_value"):
            if isinstance(data.get(name), str):
                data[name] = redact(data[name])
        return data
