"""Adapters in host memory: loaded from the store in the background, kept LRU.

The engine asks for an adapter when a request names it; the load (read, check, convert)
runs on a background thread so running decodes never wait for a disk. An adapter that
some request still needs is never evicted; beyond ``capacity`` the others go, the least
recently used of the tenant furthest over its share first (engine/lora/shares.py). A tenant
holding more than its plan's ``max_resident_adapters`` lets go of its own idle ones first,
whatever room is left: it keeps beyond its limit only the adapters its requests use.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from engine.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from engine.lora.shares import Owner, fair_victim, over_limit
from engine.lora.store import AdapterStore
from engine.metrics import ADAPTER_LOAD_BUCKETS_S, Histogram
from engine.models.model_config import ModelConfig

log = logging.getLogger(__name__)


class AdapterCache:
    def __init__(self, store: AdapterStore, model: ModelConfig, *, max_rank: int,
                 dtype: torch.dtype, capacity: int,
                 owners: dict[str, Owner] | None = None,
                 limits: dict[str, int] | None = None) -> None:
        self.store = store
        self.model = model
        self.max_rank = max_rank
        self.dtype = dtype
        self.capacity = capacity
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._pending: dict[str, Future[LoRAAdapter]] = {}
        self._refs: dict[str, int] = {}
        self.owners = owners if owners is not None else {}  # adapter -> its tenant, weight
        self.limits = limits if limits is not None else {}  # tenant -> its adapters at most
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-load")
        # NOTE: written by the one loading thread (and at start, before it runs).
        self.load_seconds = Histogram(ADAPTER_LOAD_BUCKETS_S)

    def __contains__(self, adapter_hash: str) -> bool:
        return adapter_hash in self._loaded

    def loaded(self) -> list[str]:
        return list(self._loaded)

    def get(self, adapter_hash: str) -> LoRAAdapter:
        self._loaded.move_to_end(adapter_hash)
        return self._loaded[adapter_hash]

    def load_now(self, adapter_hash: str) -> LoRAAdapter:
        """Loads on the caller's thread (start-up, pinned adapters)."""
        if adapter_hash not in self._loaded:
            self._loaded[adapter_hash] = self._load(adapter_hash)
        return self.get(adapter_hash)

    def retain(self, adapter_hash: str) -> None:
        """A request needs it: starts loading it if needed, and keeps it from eviction."""
        self._refs[adapter_hash] = self._refs.get(adapter_hash, 0) + 1
        if adapter_hash not in self._loaded and adapter_hash not in self._pending:
            self._pending[adapter_hash] = self._pool.submit(self._load, adapter_hash)

    def release(self, adapter_hash: str) -> None:
        self._refs[adapter_hash] -= 1
        if not self._refs[adapter_hash]:
            del self._refs[adapter_hash]
        self._evict()

    def wait(self, timeout: float) -> None:
        """Blocks until some pending load finishes, at most ``timeout`` seconds."""
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Loads finished since the last poll: (ready hashes, (failed hash, reason))."""
        ready, failed = [], []
        for adapter_hash, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[adapter_hash]
            try:
                self._loaded[adapter_hash] = future.result()
                ready.append(adapter_hash)
            except AdapterError as exc:
                failed.append((adapter_hash, str(exc)))
            except Exception as exc:  # noqa: BLE001 - reported to the requests, logged here
                log.exception("loading adapter %s failed", adapter_hash)
                failed.append((adapter_hash, f"the adapter could not be loaded: {exc}"))
        self._evict()
        return ready, failed

    def forget(self, adapter_hash: str) -> None:
        """Drops a deleted adapter from memory once no request needs it."""
        if adapter_hash not in self._refs:
            self._loaded.pop(adapter_hash, None)

    def _load(self, adapter_hash: str) -> LoRAAdapter:
        started = time.monotonic()
        adapter = self._read(adapter_hash)
        self.load_seconds.observe(time.monotonic() - started)
        return adapter

    def _read(self, adapter_hash: str) -> LoRAAdapter:
        if not self.store.exists(adapter_hash) and self.store.can_fetch:
            try:
                self.store.fetch(adapter_hash)
            except Exception as exc:  # noqa: BLE001 - reported to the request as a reason
                raise AdapterError(f"adapter {adapter_hash} could not be fetched: {exc}") \
                    from None
        if not self.store.exists(adapter_hash):
            raise AdapterError(f"adapter {adapter_hash} is not in the adapter store")
        return load_adapter(self.store.path(adapter_hash), self.model, max_rank=self.max_rank,
                            adapter_hash=adapter_hash, dtype=self.dtype)

    def _evict(self) -> None:
        while (victim := over_limit((a for a in self._loaded if a not in self._refs),
                                    self._loaded, self.owners, self.limits)) is not None:
            del self._loaded[victim]
        while len(self._loaded) > self.capacity:
            victim = fair_victim((a for a in self._loaded if a not in self._refs),
                                 self._loaded, self.owners)
            if victim is None:
                return
            del self._loaded[victim]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
