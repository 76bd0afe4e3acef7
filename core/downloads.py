"""File downloads that stream in constant memory under ASGI as well as WSGI.

Django's FileResponse reads its file through a synchronous iterator. Served by the ASGI
handler, such an iterator is first collected into a list in a worker thread, so a 30 MB
ledger export or a 500 MB adapter would be held whole in the web process's memory before a
byte went out. `FileDownload` hands the ASGI handler an asynchronous iterator instead: each
block is read in a thread as the client takes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.http import FileResponse

_next_block = sync_to_async(next, thread_sensitive=False)


class FileDownload(FileResponse):
    """A FileResponse (same arguments, headers and WSGI behaviour) read block by block
    when served asynchronously."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        blocks = iter(self.streaming_content)
        while (block := await _next_block(blocks, None)) is not None:
            yield block
