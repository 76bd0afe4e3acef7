"""OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`), for API keys with the
inference scope; another tenant's ids read as unknown (docs/batches.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from batches import selectors as batch_selectors
from batches import services as batch_services
from batches.models import Batch, File
from core.errors import ApiError, InvalidRequest
from inference.auth import authenticate
from inference.views import json_body
from tenants.facade import Principal, tenant_of

Handler = Callable[..., Awaitable[HttpResponse]]


def methods(**handlers: Handler) -> Callable[..., Awaitable[HttpResponse]]:
    """One URL's view from a handler per method, each given the caller's principal;
    OpenAI-shaped errors, no CSRF (the API authenticates by header)."""

    @csrf_exempt
    async def view(request: HttpRequest, **kwargs: Any) -> HttpResponse:
        try:
            handler = handlers.get(request.method.lower())
            if handler is None:
                allowed = ", ".join(m.upper() for m in handlers)
                raise ApiError(f"method {request.method} is not allowed here; use {allowed}",
                               status=405, code="method_not_allowed")
            principal = await authenticate(request.headers.get("Authorization"))
            return await handler(request, principal, **kwargs)
        except ApiError as exc:
            return exc.response()

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


def _page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def _limit(request: HttpRequest, default: int = 20, most: int = 100) -> int:
    raw = request.GET.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"limit must be a whole number from 1 to {most}", param="limit",
                             code="invalid_value")
    return int(raw)


# --- files ---------------------------------------------------------------------------------

def _upload(request: HttpRequest, principal: Principal) -> File:
    upload = request.FILES.get("file")
    if upload is None:
        raise InvalidRequest("'file' is required: a multipart upload of the file",
                             param="file", code="missing_required_parameter")
    purpose = request.POST.get("purpose")
    if not purpose:
        raise InvalidRequest("'purpose' is required", param="purpose",
                             code="missing_required_parameter")
    return batch_services.file_create(tenant=tenant_of(principal), filename=upload.name or "",
                                      purpose=purpose, data=upload.read())


async def _file_create(request: HttpRequest, principal: Principal) -> HttpResponse:
    created = await sync_to_async(_upload)(request, principal)
    return JsonResponse(file_object(created))


async def _file_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    limit = _limit(request, default=100, most=10_000)

    def read() -> tuple[list[dict[str, Any]], bool]:
        rows = batch_selectors.file_list(tenant=tenant_of(principal),
                                         purpose=request.GET.get("purpose"),
                                         after=request.GET.get("after"),
                                         order=request.GET.get("order", "desc"))[:limit + 1]
        found = [file_object(f) for f in rows]
        return found[:limit], len(found) > limit

    items, more = await sync_to_async(read)()
    return JsonResponse(_page(items, more))


async def _file_get(request: HttpRequest, principal: Principal, file_id: str) -> HttpResponse:
    found = await sync_to_async(batch_services.file_get)(
        tenant=await sync_to_async(tenant_of)(principal), file_id=file_id)
    return JsonResponse(file_object(found))


async def _file_delete(request: HttpRequest, principal: Principal,
                       file_id: str) -> HttpResponse:
    await sync_to_async(batch_services.file_delete)(
        tenant=await sync_to_async(tenant_of)(principal), file_id=file_id)
    return JsonResponse({"id": file_id, "object": "file", "deleted": True})


async def _file_content(request: HttpRequest, principal: Principal,
                        file_id: str) -> HttpResponse:
    def open_() -> tuple[File, Any]:
        found = batch_services.file_get(tenant=tenant_of(principal), file_id=file_id)
        return found, batch_services.file_content(found)

    found, handle = await sync_to_async(open_)()
    response = StreamingHttpResponse(_chunks(handle), content_type="application/jsonl")
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

async def _batch_create(request: HttpRequest, principal: Principal) -> HttpResponse:
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

    def create() -> Batch:
        return batch_services.batch_create(
            tenant=tenant_of(principal), api_key_id=principal.api_key_id,
            input_file_id=body["input_file_id"], endpoint=body["endpoint"],
            completion_window=body["completion_window"], metadata=body.get("metadata"))

    batch = await sync_to_async(create)()
    return JsonResponse(batch_object(batch))


async def _batch_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    limit = _limit(request)

    def read() -> tuple[list[dict[str, Any]], bool]:
        rows = batch_selectors.batch_list(tenant=tenant_of(principal),
                                          after=request.GET.get("after"))[:limit + 1]
        found = [batch_object(b) for b in rows]
        return found[:limit], len(found) > limit

    items, more = await sync_to_async(read)()
    return JsonResponse(_page(items, more))


async def _batch_get(request: HttpRequest, principal: Principal, batch_id: str) -> HttpResponse:
    found = await sync_to_async(batch_services.batch_get)(
        tenant=await sync_to_async(tenant_of)(principal), batch_id=batch_id)
    return JsonResponse(batch_object(found))


async def _batch_cancel(request: HttpRequest, principal: Principal,
                        batch_id: str) -> HttpResponse:
    found = await sync_to_async(batch_services.batch_cancel)(
        tenant=await sync_to_async(tenant_of)(principal), batch_id=batch_id)
    return JsonResponse(batch_object(found))


batches = methods(post=_batch_create, get=_batch_list)
batch_detail = methods(get=_batch_get)
batch_cancel = methods(post=_batch_cancel)
