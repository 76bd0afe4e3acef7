"""How large a request body each route takes, and from whom: the one place that decides.

Every body may be up to ATRIUM_MAX_BODY_BYTES, arriving within ATRIUM_BODY_TIMEOUT_S. A
view that takes more declares it on the handler of the method that reads the body
(``@body_policy(...)``): the larger limit, and which callers it is for. platform/atrium/
asgi.py:BodyLimit asks `allowance()` before Django reads a byte of the body (Django would
spool all of it to disk first), and `allowance()` finds the policy by resolving the path
through the URLconf, so a route's policy moves with its view. A path the URLconf does not
know, and any caller the policy does not know, gets the ordinary limit.

The views authenticate their callers again: the check here only decides how much may be
read, and a key revoked in between is still refused by the view.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from importlib import import_module
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import SESSION_KEY
from django.http import parse_cookie
from django.urls import Resolver404, get_resolver

Scope = dict[str, Any]
Handler = TypeVar("Handler", bound=Callable[..., Any])

# Room for a multipart form's framing around the file it carries.
MULTIPART_FRAMING = 1 << 20


@dataclass(frozen=True, slots=True)
class Sender:
    """A caller a policy lets send more. ``tenant_id``: whose turn its upload takes (None:
    a console session, whose rights the view checks)."""

    tenant_id: int | None


# Given the request's ASGI scope and the URL's arguments: the caller, if it may send more.
SenderCheck = Callable[[Scope, dict[str, Any]], Awaitable[Sender | None]]


@dataclass(frozen=True, slots=True)
class BodyPolicy:
    """A route's larger body: up to the setting ``limit_setting`` (plus ``framing``) within
    the setting ``timeout_setting``, for the callers ``sender`` knows. Anyone else meets the
    ordinary limit, and its 413 ends with ``hint`` (who may send more). With ``turn``, a
    known tenant's uploads take turns: ``turn(tenant_id)`` is held from the body's first
    byte to the answer."""

    limit_setting: str
    sender: SenderCheck
    hint: str
    framing: int = 0
    timeout_setting: str = "ATRIUM_UPLOAD_TIMEOUT_S"
    turn: Callable[[int], AbstractAsyncContextManager[None]] | None = None

    def limit(self) -> int:
        return getattr(settings, self.limit_setting) + self.framing


def body_policy(policy: BodyPolicy) -> Callable[[Handler], Handler]:
    """Declares the policy of a method's handler: a class-based view's method (``post``), or
    a handler of a function view that names its handlers by method (``view.handlers``)."""

    def declare(handler: Handler) -> Handler:
        handler.body_policy = policy  # type: ignore[attr-defined]
        return handler

    return declare


def policy_of(view: Callable[..., Any], method: str) -> BodyPolicy | None:
    """The policy `view` declares for requests with `method`, if any."""
    name = method.lower()
    view_class = getattr(view, "view_class", None)  # as_view(), Django's or DRF's
    if view_class is None:
        handler = getattr(view, "handlers", {}).get(name, view)
    elif name in view_class.http_method_names:
        handler = getattr(view_class, name, None)
    else:
        return None
    return getattr(handler, "body_policy", None)


@dataclass(frozen=True, slots=True)
class Allowance:
    """What one request may send: bytes, the seconds its body may take to arrive, who may
    send more when it is refused (the 413's hint), and what it holds while it runs."""

    limit: int
    seconds: float
    hint: str = ""
    turn: AbstractAsyncContextManager[Any] = contextlib.nullcontext()


async def allowance(scope: Scope) -> Allowance:
    """The allowance of the HTTP request `scope`: its route's policy for a caller the policy
    knows, else the ordinary limit."""
    ordinary = Allowance(settings.ATRIUM_MAX_BODY_BYTES, settings.ATRIUM_BODY_TIMEOUT_S)
    try:
        match = get_resolver().resolve(scope["path"])
    except Resolver404:
        return ordinary
    policy = policy_of(match.func, scope["method"])
    if policy is None:
        return ordinary
    sender = await policy.sender(scope, match.kwargs)
    if sender is None:
        return Allowance(ordinary.limit, ordinary.seconds, hint=policy.hint)
    turn = (contextlib.nullcontext() if policy.turn is None or sender.tenant_id is None
            else policy.turn(sender.tenant_id))
    return Allowance(policy.limit(), getattr(settings, policy.timeout_setting), turn=turn)


def authorization(scope: Scope) -> str | None:
    """The request's Authorization header as the view will read it (several are joined
    with commas, as Django joins them), or None."""
    values = [value for name, value in scope.get("headers", []) if name == b"authorization"]
    return b",".join(values).decode("latin-1") if values else None


async def signed_in(scope: Scope) -> bool:
    """Whether the request's session cookie is a live console session with a user."""
    cookies = b"; ".join(value for name, value in scope.get("headers", []) if name == b"cookie")
    session_key = parse_cookie(cookies.decode("latin-1")).get(settings.SESSION_COOKIE_NAME)
    return bool(session_key) and await sync_to_async(_has_user)(session_key)


def _has_user(session_key: str) -> bool:
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    return store.get(SESSION_KEY) is not None
