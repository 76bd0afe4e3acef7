"""Adapters' files behind Django's storage API: local folder by default, or S3.

Two kinds of object live there:
- ``uploads/<upload id>/<offset>``: the chunks of an upload as received, each its own
  object (object stores cannot append), removed once the upload is validated or dropped;
- ``<content hash>/adapter_model.safetensors`` and ``<content hash>/adapter_config.json``:
  validated adapters, content-addressed (engine/lora/store.py). With the local backend
  this folder is the engines' adapter store; with S3 engines fetch through the platform
  (``/internal/adapters/<hash>/<file>``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from django.core.files import File
from django.core.files.storage import Storage, storages

from engine.lora.store import CONFIG_FILE, WEIGHTS_FILE, content_hash, is_hash

FILES = (WEIGHTS_FILE, CONFIG_FILE)  # NOTE: weights first: the config's arrival marks it whole


class AdapterFiles:
    def __init__(self, storage: Storage | None = None) -> None:
        self.storage = storage or storages["adapters"]

    # -- uploads --------------------------------------------------------------------------

    def save_chunk(self, upload_id: str, offset: int, data: BinaryIO) -> None:
        self.storage.save(f"uploads/{upload_id}/{offset:016d}", File(data))

    def chunks(self, upload_id: str) -> list[str]:
        try:
            _, names = self.storage.listdir(f"uploads/{upload_id}")
        except FileNotFoundError:
            return []
        return sorted(names)

    def assemble(self, upload_id: str, dest: Path) -> int:
        """Writes an upload's chunks in order into ``dest``; returns its size."""
        size = 0
        with dest.open("wb") as out:
            for name in self.chunks(upload_id):
                with self.storage.open(f"uploads/{upload_id}/{name}", "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                size = out.tell()
        return size

    def delete_upload(self, upload_id: str) -> None:
        for name in self.chunks(upload_id):
            self.storage.delete(f"uploads/{upload_id}/{name}")
        if hasattr(self.storage, "path"):  # the local backend leaves the empty folder
            shutil.rmtree(Path(self.storage.path(f"uploads/{upload_id}")), ignore_errors=True)

    # -- validated adapters ---------------------------------------------------------------

    def exists(self, adapter_hash: str) -> bool:
        return is_hash(adapter_hash) and all(
            self.storage.exists(f"{adapter_hash}/{name}") for name in FILES)

    def put(self, folder: Path) -> str:
        """Stores a checked adapter folder under its content hash; returns the hash."""
        digest = content_hash(folder)
        for name in FILES:
            key = f"{digest}/{name}"
            if not self.storage.exists(key):
                with (folder / name).open("rb") as f:
                    saved = self.storage.save(key, File(f))
                if saved != key:  # a concurrent writer won: the same content, keep one
                    self.storage.delete(saved)
        return digest

    def open(self, adapter_hash: str, name: str) -> BinaryIO:
        if not is_hash(adapter_hash) or name not in FILES:
            raise FileNotFoundError(name)
        return self.storage.open(f"{adapter_hash}/{name}", "rb")

    def delete(self, adapter_hash: str) -> None:
        if not is_hash(adapter_hash):
            return
        for name in reversed(FILES):  # config first: it marks the adapter whole
            self.storage.delete(f"{adapter_hash}/{name}")
        if hasattr(self.storage, "path"):
            shutil.rmtree(Path(self.storage.path(adapter_hash)), ignore_errors=True)

    def stream(self, adapter_hash: str, name: str, chunk: int = 1 << 20) -> Iterator[bytes]:
        with self.open(adapter_hash, name) as f:
            yield from iter(lambda: f.read(chunk), b"")
