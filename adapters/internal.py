"""What engines fetch from the platform: a validated adapter's files, by content hash.

Only for engines that cannot read the adapter store directly (S3 storage): they send
``Authorization: Bearer $ATRIUM_ENGINE_TOKEN``. With no token configured the endpoint
answers 404, as if it did not exist.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from adapters.storage import AdapterFiles
from core.downloads import FileDownload


@require_GET
def adapter_file(request: HttpRequest, adapter_hash: str, filename: str) -> HttpResponse:
    token = settings.ATRIUM_ENGINE_TOKEN
    sent = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    files = AdapterFiles()
    if not token or not hmac.compare_digest(sent.encode(), token.encode()) \
            or not files.exists(adapter_hash):
        return JsonResponse({"error": {"message": "not found", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}}, status=404)
    try:
        return FileDownload(files.open(adapter_hash, filename),
                            content_type="application/octet-stream")
    except FileNotFoundError:
        return JsonResponse({"error": {"message": "not found", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}}, status=404)
