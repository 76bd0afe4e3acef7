"""OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`), for API keys with the
inference scope; another tenant's ids read as unknown (docs/batches.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import sync_to_async
from django.core.files.uploadhandler import TemporaryFileUploadHandler
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from batches import facade as batch_facade
from batches.facade import BatchInfo, FileInfo
from core.bodies import MULTIPART_FRAMING, BodyPolicy, body_policy
from core.errors import ApiError, InvalidRequest
from inference.auth import authenticate, inference_key_sender
from inference.views import json_body
from tenants.facade import Principal

# (request, the caller's principal, the URL's arguments) -> the answer
Handler = Callable[..., HttpResponse]

# NOTE: the handlers run on threads of their own: never the process's one thread-sensitive
# thread (asgi.DjangoHandler: every inference request's request_started receivers and
# key-cache misses wait on it), nor the loop's default executor (where the inference path
# tokenizes). Uploads, which read a whole file, have their own two, so a long one delays
# neither inference nor the other Files and Batch calls.
_CALLS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="atrium-files-api")
_UPLOADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="atrium-files-upload")


class TenantTurns:
    """One upload per tenant at a time (in this process), from its body's first byte to its
    answer: a tenant's tenth upload waits behind its ninth, on the loop, its body not read
    (the client's sending is held back), while another tenant's does not wait behind
    either. platform/atrium/asgi.py takes the turn before the body is read."""

    def __init__(self) -> None:
        self._locks: dict[int, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def turn(self, tenant_id: int) -> AsyncIterator[None]:
        lock, users = self._locks.get(tenant_id) or (asyncio.Lock(), 0)
        self._locks[tenant_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[tenant_id]
            if users == 1:
                del self._locks[tenant_id]
            else:
                self._locks[tenant_id] = (lock, users - 1)


upload_turns = TenantTurns()

# A batch input file past the ordinary body limit, from a caller with an inference key.
FILE_UPLOAD = BodyPolicy(limit_setting="ATRIUM_FILE_MAX_BYTES", framing=MULTIPART_FRAMING,
                         sender=inference_key_sender, turn=upload_turns.turn,
                         hint="larger files need an API key with the inference scope")


def upload(handler: Handler) -> Handler:
    """Marks a handler that reads a whole upload: it runs on the upload threads."""
    handler.reads_upload = True  # type: ignore[attr-defined]
    return handler


def methods(**handlers: Handler) -> Callable[..., Awaitable[HttpResponse]]:
    """One URL's view from a handler per method. A handler is synchronous: it runs off the
    event loop in one hop, on the Files and Batch APIs' own threads, and acts for the
    principal's tenant. Errors are OpenAI-shaped; no CSRF (the API authenticates by
    header)."""

    def run(handler: Handler, request: HttpRequest, principal: Principal,
            kwargs: dict[str, Any]) -> HttpResponse:
        # NOTE: this thread's database connection is its own, closed after each call (as
        # Django's request signals do for the thread they run on).
        close_old_connections()
        try:
            return handler(request, principal, **kwargs)
        except ApiError as exc:
            return exc.response()
        finally:
            close_old_connections()

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
        executor = _UPLOADS if getattr(handler, "reads_upload", False) else _CALLS
        return await sync_to_async(run, thread_sensitive=False, executor=executor)(
            handler, request, principal, kwargs)

    view.handlers = handlers  # type: ignore[attr-defined] # where core.bodies finds policies
    return view


def _whole(text: str) -> bool:
    """ASCII digits, few enough for int() (str.isdigit admits "²" and other digits)."""
    return text.isascii() and text.isdigit() and len(text) <= 12


def _ts(moment) -> int | None:
    return None if moment is None else int(moment.timestamp())


def file_object(f: FileInfo) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": f.bytes,
            "created_at": int(f.created_at.timestamp()), "filename": f.filename,
            "purpose": f.purpose, "status": "processed", "status_details": None,
            "expires_at": _ts(f.expires_at)}


def batch_object(b: BatchInfo) -> dict[str, Any]:
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


def _page(fetch: Callable[[int], list[Any]], request: HttpRequest,
          to_object: Callable[[Any], dict[str, Any]], *, default: int = 20,
          most: int = 100) -> HttpResponse:
    """A list page in OpenAI's shape: up to ``limit`` rows (``fetch(n)``: the first n, in
    order, after any ``after``), whether more follow, and the first and last ids."""
    raw = request.GET.get("limit", str(default))
    if not _whole(raw) or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"limit must be a whole number from 1 to {most}", param="limit",
                             code="invalid_value")
    limit = int(raw)
    found = [to_object(row) for row in fetch(limit + 1)]
    items = found[:limit]
    return JsonResponse({"object": "list", "data": items,
                         "first_id": items[0]["id"] if items else None,
                         "last_id": items[-1]["id"] if items else None,
                         "has_more": len(found) > limit})


# --- files ---------------------------------------------------------------------------------

EXPIRES_AFTER = ("expires_after[anchor]", "expires_after[seconds]")


def _expires_after(form: Any) -> int | None:
    """``expires_after`` as OpenAI's clients send it in a multipart form
    (``expires_after[anchor]=created_at``, ``expires_after[seconds]=N``): the seconds, or
    None when it is not given."""
    given = {name: form.get(name) for name in form if name.startswith("expires_after")}
    if not given:
        return None
    unknown = sorted(set(given) - set(EXPIRES_AFTER))
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}; "
                             "expires_after takes anchor and seconds", param=unknown[0],
                             code="unknown_parameter")
    for name in EXPIRES_AFTER:
        if not given.get(name):
            raise InvalidRequest(f"'{name}' is required with expires_after", param=name,
                                 code="missing_required_parameter")
    if given["expires_after[anchor]"] != "created_at":
        raise InvalidRequest("expires_after[anchor] must be created_at",
                             param="expires_after[anchor]", code="invalid_value")
    seconds = given["expires_after[seconds]"]
    if not _whole(seconds):  # its range is the service's to check
        low, high = batch_facade.EXPIRES_AFTER_S
        raise InvalidRequest(f"expires_after[seconds] must be a whole number from {low} to "
                             f"{high}", param="expires_after[seconds]", code="invalid_value")
    return int(seconds)


@body_policy(FILE_UPLOAD)
@upload
def _file_create(request: HttpRequest, principal: Principal) -> HttpResponse:
    # NOTE: parsed into a temporary file whatever its size (Django's default would keep
    # one of up to FILE_UPLOAD_MAX_MEMORY_SIZE in memory), then read from there in chunks.
    request.upload_handlers = [TemporaryFileUploadHandler(request)]
    upload_file = request.FILES.get("file")
    if upload_file is None:
        raise InvalidRequest("'file' is required: a multipart upload of the file",
                             param="file", code="missing_required_parameter")
    purpose = request.POST.get("purpose")
    if not purpose:
        raise InvalidRequest("'purpose' is required", param="purpose",
                             code="missing_required_parameter")
    return JsonResponse(file_object(batch_facade.file_create(
        tenant_id=principal.tenant_id, filename=upload_file.name or "", purpose=purpose,
        data=upload_file, expires_after_s=_expires_after(request.POST))))


def _file_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    def fetch(limit: int) -> list[FileInfo]:
        return batch_facade.file_list(
            tenant_id=principal.tenant_id, purpose=request.GET.get("purpose"),
            after=request.GET.get("after"), order=request.GET.get("order", "desc"),
            limit=limit)

    return _page(fetch, request, file_object, default=100, most=10_000)


def _file_get(request: HttpRequest, principal: Principal, file_id: str) -> HttpResponse:
    return JsonResponse(file_object(batch_facade.file_get(tenant_id=principal.tenant_id,
                                                          file_id=file_id)))


def _file_delete(request: HttpRequest, principal: Principal, file_id: str) -> HttpResponse:
    batch_facade.file_delete(tenant_id=principal.tenant_id, file_id=file_id)
    return JsonResponse({"id": file_id, "object": "file", "deleted": True})


def _file_content(request: HttpRequest, principal: Principal, file_id: str) -> HttpResponse:
    found, handle = batch_facade.file_open(tenant_id=principal.tenant_id, file_id=file_id)
    response = StreamingHttpResponse(_chunks(handle), content_type="application/jsonl")
    response["Content-Length"] = str(found.bytes)
    response["Content-Disposition"] = f'attachment; filename="{found.id}.jsonl"'
    return response


async def _chunks(handle: Any) -> AsyncIterator[bytes]:
    """A file's bytes, read off the event loop."""
    read = sync_to_async(handle.read, thread_sensitive=False, executor=_CALLS)
    try:
        while chunk := await read(1 << 16):
            yield chunk
    finally:
        await sync_to_async(handle.close, thread_sensitive=False, executor=_CALLS)()


files = methods(post=_file_create, get=_file_list)
file_detail = methods(get=_file_get, delete=_file_delete)
file_content = methods(get=_file_content)


# --- batches -------------------------------------------------------------------------------

def _batch_create(request: HttpRequest, principal: Principal) -> HttpResponse:
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
    return JsonResponse(batch_object(batch_facade.batch_create(
        tenant_id=principal.tenant_id, api_key_id=principal.api_key_id,
        input_file_id=body["input_file_id"], endpoint=body["endpoint"],
        completion_window=body["completion_window"], metadata=body.get("metadata"))))


def _batch_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    def fetch(limit: int) -> list[BatchInfo]:
        return batch_facade.batch_list(tenant_id=principal.tenant_id,
                                       after=request.GET.get("after"), limit=limit)

    return _page(fetch, request, batch_object)


def _batch_get(request: HttpRequest, principal: Principal, batch_id: str) -> HttpResponse:
    return JsonResponse(batch_object(batch_facade.batch_get(tenant_id=principal.tenant_id,
                                                            batch_id=batch_id)))


def _batch_cancel(request: HttpRequest, principal: Principal, batch_id: str) -> HttpResponse:
    return JsonResponse(batch_object(batch_facade.batch_cancel(tenant_id=principal.tenant_id,
                                                               batch_id=batch_id)))


batches = methods(post=_batch_create, get=_batch_list)
batch_detail = methods(get=_batch_get)
batch_cancel = methods(post=_batch_cancel)
