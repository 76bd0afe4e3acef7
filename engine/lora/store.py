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
    """``fetch_url``: where to download an adapter this store lacks (the platform's
    ``/internal/adapters/``), with ``token``; without it the store is read-only local."""

    def __init__(self, root: Path | str, *, fetch_url: str = "", token: str = "") -> None:
        self.root = Path(root)
        self.fetch_url = fetch_url.rstrip("/")
        self.token = token

    @property
    def can_fetch(self) -> bool:
        return bool(self.fetch_url and self.token)

    def fetch(self, adapter_hash: str, timeout: float = 60.0) -> None:
        """Downloads an adapter into the store and checks it is the content it is named for."""
        import urllib.request

        self.path(adapter_hash)  # validates the name before it becomes a URL
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".fetching-", dir=self.root))
        try:
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                request = urllib.request.Request(
                    f"{self.fetch_url}/{adapter_hash}/{name}",
                    headers={"Authorization": f"Bearer {self.token}"})
                with urllib.request.urlopen(request, timeout=timeout) as reply, \
                        (staging / name).open("wb") as out:
                    shutil.copyfileobj(reply, out, 1 << 20)
            if content_hash(staging) != adapter_hash:
                raise ValueError(f"the adapter fetched for {adapter_hash} has other content")
            try:
                os.rename(staging, self.path(adapter_hash))
            except OSError:
                if not self.exists(adapter_hash):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

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
