"""What every console view shares: the signed-in person as an Actor, the tenant they act in
(another tenant's is a 404, as in the management API), the role × action checks of
tenants/access.py (the management API's own; a refusal is the 403 page), and turning the
platform's errors into messages on the page.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from redis.exceptions import RedisError

from core import errors
from tenants import access as rules
from tenants import selectors as tenant_selectors
from tenants.access import Actor, TenantAccess

TenantView = Callable[..., HttpResponse]
log = logging.getLogger(__name__)


def actor_of(request: HttpRequest) -> Actor:
    user = request.user
    return Actor(user_id=user.pk, user_email=user.email, is_staff=user.is_staff)


def abilities(tenant_access: TenantAccess) -> dict[str, bool]:
    """Every action of tenants.access.RULES as `key_create: True`, for templates to hide
    what the viewer may not do (the views check again: hiding is not enforcing)."""
    return {action.replace(".", "_"): rules.allowed(tenant_access, action)
            for action in rules.RULES}


def _translated(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """The platform's NotFound is a 404 page, its PermissionDenied a 403 page, and Redis
    out of reach (the pages with live counters) a 503 page saying so, not a 500."""
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except errors.NotFound as exc:
            raise Http404(exc.message) from None
        except errors.PermissionDenied as exc:
            raise DjangoPermissionDenied(exc.message) from None
        except RedisError:
            log.warning("console page %s: Redis unreachable", request.path, exc_info=True)
            response = render(request, "503.html", status=503)
            response["Retry-After"] = "5"
            return response
    return wrapper


def tenant_view(action: str | None, *, methods: tuple[str, ...] = ("GET",)):
    """A page of one tenant: signed in, a member (or an operator), allowed `action`.

    The view receives the TenantAccess instead of the slug. `action=None` leaves the
    check to the view (object-level rules such as a developer's own keys).
    """
    def decorate(view: TenantView) -> Callable[..., HttpResponse]:
        @login_required
        @_translated
        @wraps(view)
        def wrapper(request: HttpRequest, slug: str, **kwargs: Any) -> HttpResponse:
            if request.method not in methods and not (
                    request.method == "HEAD" and "GET" in methods):
                return HttpResponse(status=405, headers={"Allow": ", ".join(methods)})
            tenant_access = tenant_selectors.tenant_access_get(actor=actor_of(request),
                                                               slug=slug)
            if action is not None:
                rules.authorize(tenant_access, action)
            return view(request, tenant_access, **kwargs)
        wrapper.console_methods = methods  # type: ignore[attr-defined]
        return wrapper
    return decorate


def staff_view(*, methods: tuple[str, ...] = ("GET",)):
    """A page of the operator console: signed in as staff (others get 403)."""
    def decorate(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @login_required
        @_translated
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in methods and not (
                    request.method == "HEAD" and "GET" in methods):
                return HttpResponse(status=405, headers={"Allow": ", ".join(methods)})
            if not (request.user.is_active and request.user.is_staff):
                raise DjangoPermissionDenied("the operator console is for platform operators")
            return view(request, *args, **kwargs)
        wrapper.console_methods = methods  # type: ignore[attr-defined]
        return wrapper
    return decorate


def page(request: HttpRequest, template: str, context: dict[str, Any], *,
         tenant_access: TenantAccess | None = None, section: str = "",
         status: int = 200) -> HttpResponse:
    """Renders a console page with its navigation: the tenants one may switch to and what
    one may do in the current one."""
    actor = actor_of(request)
    base: dict[str, Any] = {
        "section": section,
        "switchable": list(tenant_selectors.tenant_list_for_actor(actor=actor)
                           .values_list("slug", "name")) if not actor.is_staff else [],
    }
    if tenant_access is not None:
        base.update(tenant=tenant_access.tenant, role=tenant_access.role,
                    can=abilities(tenant_access))
    response = render(request, template, {**base, **context}, status=status)
    return response


def secret_page(request: HttpRequest, template: str, context: dict[str, Any], **kwargs: Any
                ) -> HttpResponse:
    """A page that shows a secret once: never cached, never stored anywhere but the reply."""
    response = page(request, template, context, **kwargs)
    response["Cache-Control"] = "no-store"
    return response


def done(request: HttpRequest, to: str, *, ok: str = "", **url_kwargs: Any
         ) -> HttpResponseRedirect:
    if ok:
        messages.success(request, ok)
    return HttpResponseRedirect(reverse(to, kwargs=url_kwargs))


def refused(request: HttpRequest, exc: errors.ApiError | str, to: str, **url_kwargs: Any
            ) -> HttpResponseRedirect:
    """A business error (a conflict, an invalid value) back on the page it came from."""
    messages.error(request, exc if isinstance(exc, str) else exc.message)
    return HttpResponseRedirect(reverse(to, kwargs=url_kwargs))


def form_errors(form) -> str:
    parts = []
    for name, errs in form.errors.items():
        label = form.fields[name].label if name in form.fields else ""
        parts.append(f"{label or name}: {' '.join(errs)}" if name != "__all__"
                     else " ".join(errs))
    return "; ".join(parts)
