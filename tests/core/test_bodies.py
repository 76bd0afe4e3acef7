"""What body a route takes is declared by its view and found through the URLconf
(core/bodies.py); platform/atrium/asgi.py:BodyLimit enforces it before Django reads a byte.
The live checks (a known uploader gets past the ordinary limit, a stranger does not, a
tenant's uploads take turns) are in tests/adapters/test_upload_api.py and
tests/inference/test_files.py."""

from __future__ import annotations

import inspect
import json
import re
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import RequestFactory
from django.urls import URLPattern, URLResolver, get_resolver, resolve

from adapters.apis import CHUNK_UPLOAD, WHOLE_UPLOAD
from core.bodies import Allowance, BodyPolicy, allowance, policy_of
from inference.batch_views import FILE_UPLOAD

FIRST_PARTY = ("atrium", "core", "inference", "tenants", "billing", "adapters", "requestlogs",
               "batches", "webui")
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
UPLOAD_ID = uuid.UUID("675cb069-e043-4a5b-8daf-ba3c52bc4a0a")  # fixed: xdist workers collect alike


def _http(method: str, path: str, headers: list[tuple[bytes, bytes]] = ()) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "query_string": b"",
            "headers": list(headers)}


def _views(patterns=None) -> Iterator[Any]:
    """Every view the URLconf serves."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        if isinstance(entry, URLResolver):
            yield from _views(entry.url_patterns)
        elif isinstance(entry, URLPattern):
            yield entry.callback


def _declared() -> Iterator[tuple[str, BodyPolicy]]:
    """Every handler of the loaded first-party modules that declares a body policy."""
    get_resolver().url_patterns  # noqa: B018 - imports every view
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in FIRST_PARTY:
            continue
        for value in vars(module).values():
            if getattr(value, "__module__", None) != name:
                continue
            members = vars(value).items() if inspect.isclass(value) else [("", value)]
            for member, handler in members:
                policy = getattr(handler, "body_policy", None)
                if isinstance(policy, BodyPolicy):
                    yield f"{name}.{getattr(value, '__qualname__', '?')}.{member}", policy


@pytest.mark.parametrize("method, path, policy", [
    ("POST", "/v1/files", FILE_UPLOAD),
    ("POST", "/api/v1/tenants/acme/adapters", WHOLE_UPLOAD),
    ("PUT", f"/api/v1/tenants/acme/adapter-uploads/{UPLOAD_ID}", CHUNK_UPLOAD),
], ids=["files", "adapter archive", "adapter chunk"])
def test_each_upload_url_clients_use_resolves_to_the_view_declaring_its_policy(method, path,
                                                                               policy):
    assert policy_of(resolve(path).func, method) is policy


def test_every_declared_policy_is_found_through_the_urlconf():
    found = {policy_of(view, method) for view in _views() for method in METHODS} - {None}
    declared = dict(_declared())
    assert set(declared.values()) == {FILE_UPLOAD, WHOLE_UPLOAD, CHUNK_UPLOAD}
    lost = sorted(where for where, policy in declared.items() if policy not in found)
    assert not lost, f"declared, but no route of the URLconf leads to them: {lost}"


def test_the_asgi_wrapper_keeps_no_copy_of_the_urlconf():
    from atrium import asgi

    assert "re.compile" not in inspect.getsource(asgi)
    assert not any(isinstance(value, re.Pattern)
                   for value in [*vars(asgi).values(), *vars(asgi.BodyLimit).values()])


@pytest.mark.parametrize("method, path", [
    ("POST", "/no/such/route"), ("POST", "/v1/files/extra/parts"),
    ("PUT", "/api/v1/tenants/acme/adapter-uploads/not-a-uuid"),
    ("POST", "/v1/chat/completions"),  # a route without a policy
    ("GET", "/v1/files"),  # a method without one
])
async def test_a_path_or_method_without_a_policy_gets_the_ordinary_limit(method, path,
                                                                         settings):
    settings.ATRIUM_MAX_BODY_BYTES = 1234
    settings.ATRIUM_BODY_TIMEOUT_S = 7.0
    assert await allowance(_http(method, path)) == Allowance(1234, 7.0)


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/files"), ("POST", "/api/v1/tenants/acme/adapters"),
    ("PUT", f"/api/v1/tenants/acme/adapter-uploads/{UPLOAD_ID}"),
])
async def test_a_caller_a_policy_does_not_know_gets_the_ordinary_limit_and_who_may_send_more(
        method, path, settings):
    settings.ATRIUM_MAX_BODY_BYTES = 1234
    allowed = await allowance(_http(method, path))
    assert (allowed.limit, allowed.seconds) == (1234, settings.ATRIUM_BODY_TIMEOUT_S)
    assert allowed.hint.startswith("larger ")


async def _through_body_limit(scope: dict[str, Any], body: bytes) -> tuple[list, bool]:
    """What BodyLimit sends for one request, and whether the app behind it was called."""
    from atrium.asgi import BodyLimit

    called, sent = False, []

    async def app(scope, receive, send):
        nonlocal called
        called = True
        while (await receive()).get("more_body"):
            pass

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    await BodyLimit(app)(scope, receive, send)
    return sent, called


async def test_an_unknown_path_over_the_ordinary_limit_is_a_413_before_the_app(settings):
    settings.ATRIUM_MAX_BODY_BYTES = 1234
    length = [(b"content-length", b"1235")]
    sent, called = await _through_body_limit(_http("POST", "/no/such/route", length),
                                             b"x" * 1235)
    assert not called and sent[0]["status"] == 413
    assert json.loads(sent[1]["body"]) == {"error": {
        "message": "the request body is larger than 1234 bytes",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}}
    # Without a Content-Length: refused as the bytes arrive.
    sent, called = await _through_body_limit(_http("POST", "/no/such/route"), b"x" * 1235)
    assert sent[0]["status"] == 413
    _, called = await _through_body_limit(_http("POST", "/no/such/route"), b"x" * 1234)
    assert called


def test_without_the_server_in_front_djangos_cap_gives_the_same_413(settings):
    from inference.errors import BodyTooLarge
    from inference.views import json_body

    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1234
    request = RequestFactory().post("/v1/chat/completions", data=b"[" + b" " * 1234 + b"]",
                                    content_type="application/json")
    with pytest.raises(BodyTooLarge) as refused:
        json_body(request)
    assert refused.value.status == 413
    assert refused.value.message == "the request body is larger than 1234 bytes"
