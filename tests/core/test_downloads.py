"""Downloads (ledger exports, adapter files) stream block by block under ASGI."""

from __future__ import annotations

import asyncio
import io
import warnings

from core.downloads import FileDownload


class CountingFile(io.BytesIO):
    reads = 0

    def read(self, size=-1):
        self.reads += 1
        return super().read(size)


def test_an_asgi_server_gets_the_file_a_block_at_a_time():
    data = bytes(range(256)) * 4096  # 1 MiB
    source = CountingFile(data)
    response = FileDownload(source, as_attachment=True, filename="ledger.csv")
    response.block_size = 64 * 1024

    async def take_all():
        seen, reads_at_first = [], None
        async for block in response:
            seen.append(block)
            if reads_at_first is None:
                reads_at_first = source.reads
        return seen, reads_at_first

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Django's "must consume synchronous iterators"
        blocks, reads_at_first = asyncio.run(take_all())
    assert reads_at_first == 1  # the first block went out before the rest was read
    assert b"".join(blocks) == data
    assert len(blocks) == 16
    assert response["Content-Length"] == str(len(data))
    assert 'filename="ledger.csv"' in response["Content-Disposition"]


def test_a_wsgi_server_gets_the_same_bytes():
    data = b"request_id,cost\n" * 10_000
    response = FileDownload(io.BytesIO(data), content_type="text/csv")
    assert b"".join(response) == data
    assert response["Content-Type"] == "text/csv"
