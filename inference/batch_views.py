"""OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`), for API keys with the
inference scope; another tenant's ids read as unknown (docs/batches.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from batches import selectors as batch_selectors
from batches import services as batch_services
from batches.models import Batch, File
from core.errors import ApiError, InvalidRequest
from inference.auth import authenticate
from inference.views import json_body
from tenants.facade import Principal, Tenant, tenant_of

# (request, the caller's principal, its tenant, the URL's arguments) -> the answer
Handler = Callable[..., HttpResponse]


def methods(**handlers: Handler) -> Callable[..., Awaitable[HttpResponse]]:
    """One URL's view from a handler per method. A handler is synchronous: it runs off the
    event loop in one hop, with the caller's tenant looked up in the same hop. Errors are
    OpenAI-shaped; no CSRF (the API authenticates by header)."""

    def run(handler: Handler, request: HttpRequest, principal: Principal,
            kwargs: dict[str, Any]) -> HttpResponse:
        try:
            return handler(request, principal, tenant_of(principal), **kwargs)
        except ApiError as exc:
            return exc.response()

    @csrf_exempt
    async def view(request: HttpRequest, **kwargs: Any) -> HttpResponse:
        handler = handlers.get(request.method.lower())
        try:
            if handler is None:
                allowed = ", ".join(m.upper() for m in handlers)
                raise ApiError(f"method {request.method} is not allowed here; use {allowed}",
                               status=405, code="method_not_allowed")
            principal = await authenticate(request.headers.get("Authorization"))
        except ApiError as exc:
            return exc.response()
        return await sync_to_async(run)(handler, request, principal, kwargs)

    return view


def file_object(f: File) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": f.bytes,
            "created_at": int(f.created_at.timestamp()), "filename": f.filename,
            "purpose": f.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


def _ts(moment) -> int | None:
    return None if moment is None else int(moment.timestamp())


def batch_object(b: Batch) -> dict[str, Any]:
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint,
        "errors": b.errors, "input_file_id": b.input_file_ref,
        "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
        "created_at": _ts(b.created_at), "in_progress_at": _ts(b.in_progress_at),
        "expires_at": _ts(b.expires_at), "finalizing_at": _ts(b.finalizing_at),
        "completed_at": _ts(b.completed_at), "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.expired_at), "cancelling_at": _ts(b.cancelling_at),
        "cancelled_at": _ts(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": b.metadata,
    }


def _page(rows: QuerySet, request: HttpRequest, to_object: Callable[[Any], dict[str, Any]],
          *, default: int = 20, most: int = 100) -> HttpResponse:
    """A list page in OpenAI's shape: up to ``limit`` of ``rows`` (ordered, after any
    ``after``), whether more follow, and the first and last ids."""
    raw = request.GET.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"limit must be a whole number from 1 to {most}", param="limit",
                             code="invalid_value")
    limit = int(raw)
    found = [to_object(row) for row in rows[:limit + 1]]
    items = found[:limit]
    return JsonResponse({"object": "list", "data": items,
                         "first_id": items[0]["id"] if items else None,
                         "last_id": items[-1]["id"] if items else None,
                         "has_more": len(found) > limit})


# --- files ---------------------------------------------------------------------------------

def _file_create(request: HttpRequest, principal: Principal, tenant: Tenant) -> HttpResponse:
    upload = request.FILES.get("file")
    if upload is None:
        raise InvalidRequest("'file' is required: a multipart upload of the file",
                             param="file", code="missing_required_parameter")
    purpose = request.POST.get("purpose")
    if not purpose:
        raise InvalidRequest("'purpose' is required", param="purpose",
                             code="missing_required_parameter")
    return JsonResponse(file_object(batch_services.file_create(
        tenant=tenant, filename=upload.name or "", purpose=purpose, data=upload.read())))


def _file_list(request: HttpRequest, principal: Principal, tenant: Tenant) -> HttpResponse:
    rows = batch_selectors.file_list(tenant=tenant, purpose=request.GET.get("purpose"),
                                     after=request.GET.get("after"),
                                     order=request.GET.get("order", "desc"))
    return _page(rows, request, file_object, default=100, most=10_000)


def _file_get(request: HttpRequest, principal: Principal, tenant: Tenant,
              file_id: str) -> HttpResponse:
    return JsonResponse(file_object(batch_services.file_get(tenant=tenant, file_id=file_id)))


def _file_delete(request: HttpRequest, principal: Principal, tenant: Tenant,
                 file_id: str) -> HttpResponse:
    batch_services.file_delete(tenant=tenant, file_id=file_id)
    return JsonResponse({"id": file_id, "object": "file", "deleted": True})


def _file_content(request: HttpRequest, principal: Principal, tenant: Tenant,
                  file_id: str) -> HttpResponse:
    found = batch_services.file_get(tenant=tenant, file_id=file_id)
    response = StreamingHttpResponse(_chunks(batch_services.file_content(found)),
                                     content_type="application/jsonl")
    response["Content-Length"] = str(found.bytes)
    response["Content-Disposition"] = f'attachment; filename="{found.id}.jsonl"'
    return response


async def _chunks(handle: Any) -> AsyncIterator[bytes]:
    """A file's bytes, read off the event loop."""
    try:
        while chunk := await sync_to_async(handle.read, thread_sensitive=False)(1 << 16):
            yield chunk
    finally:
        await sync_to_async(handle.close, thread_sensitive=False)()


files = methods(post=_file_create, get=_file_list)
file_detail = methods(get=_file_get, delete=_file_delete)
file_content = methods(get=_file_content)


# --- batches -------------------------------------------------------------------------------

def _batch_create(request: HttpRequest, principal: Principal, tenant: Tenant) -> HttpResponse:
    body = json_body(request)
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", code="invalid_value")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window",
                                  "metadata"})
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}",
                             param=unknown[0], code="unknown_parameter")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise InvalidRequest(f"'{name}' is required, a string", param=name,
                                 code="missing_required_parameter")
    return JsonResponse(batch_object(batch_services.batch_create(
        tenant=tenant, api_key_id=principal.api_key_id, input_file_id=body["input_file_id"],
        endpoint=body["endpoint"], completion_window=body["completion_window"],
        metadata=body.get("metadata"))))


def _batch_list(request: HttpRequest, principal: Principal, tenant: Tenant) -> HttpResponse:
    rows = batch_selectors.batch_list(tenant=tenant, after=request.GET.get("after"))
    return _page(rows, request, batch_object)


def _batch_get(request: HttpRequest, principal: Principal, tenant: Tenant,
               batch_id: str) -> HttpResponse:
    return JsonResponse(batch_object(batch_services.batch_get(tenant=tenant,
                                                              batch_id=batch_id)))


def _batch_cancel(request: HttpRequest, principal: Principal, tenant: Tenant,
                  batch_id: str) -> HttpResponse:
    return JsonResponse(batch_object(batch_services.batch_cancel(tenant=tenant,
                                                                 batch_id=batch_id)))


batches = methods(post=_batch_create, get=_batch_list)
batch_detail = methods(get=_batch_get)
batch_cancel = methods(post=_batch_cancel)
