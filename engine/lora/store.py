"""The adapter store: PEFT adapters on a shared filesystem, named by their content hash.

Layout: ``<root>/<content hash>/adapter_config.json`` and ``adapter_model.safetensors``.
The platform writes an adapter once it has validated it; engines read it by hash when a
request names it. A hash names one content forever, so an engine never serves a stale
copy, and a replaced adapter is a new hash (its prefix-cache entries are unreachable).

Pure Python (no torch, no Django): the platform imports it too.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_HASH = re.compile(r"^[0-9a-f]{64}$")


def content_hash(adapter_dir: Path) -> str:
    """sha256 over the two files, each preceded by its name and size."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        path = Path(adapter_dir) / name
        h.update(f"{name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def is_hash(value: object) -> bool:
    return isinstance(value, str) and bool(_HASH.match(value))


class AdapterStore:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def path(self, adapter_hash: str) -> Path:
        # NOTE: checked before it becomes a path, so a request can never name "../x".
        if not is_hash(adapter_hash):
            raise ValueError("an adapter is named by a 64-character lowercase hex hash")
        return self.root / adapter_hash

    def exists(self, adapter_hash: str) -> bool:
        path = self.path(adapter_hash)
        return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()

    def put(self, adapter_dir: Path | str) -> str:
        """Copies an adapter folder's two files in (atomically) and returns its hash."""
        src = Path(adapter_dir)
        digest = content_hash(src)
        if self.exists(digest):
            return digest
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))
        try:
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                shutil.copyfile(src / name, staging / name)
            if content_hash(staging) != digest:
                raise ValueError("the adapter changed while it was being stored")
            try:
                os.rename(staging, self.path(digest))
            except OSError:
                if not self.exists(digest):  # anything but "another writer got there first"
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return digest

    def delete(self, adapter_hash: str) -> None:
        shutil.rmtree(self.path(adapter_hash), ignore_errors=True)
