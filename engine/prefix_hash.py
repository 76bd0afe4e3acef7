"""Prefix-cache keys, and the summary of them an engine's heartbeat carries.

Pure Python (hashlib, array): the engine keys its cached KV blocks with these, and
the web tier computes the same keys for a prompt to tell which engine holds most of
it (inference/routing.py). A key chains every block before it and, in the first
block, the request's cache scope (tenant, server-side salt, adapter), so a summary
never tells one tenant's prefix for another's.

The summary is a Bloom filter of the cached blocks' keys: bounded in size whatever
the cache holds, and never misses a block that is there (a false positive only
makes a prefix look cached that is not, at a rate ``FALSE_POSITIVE`` or so).
"""

from __future__ import annotations

import base64
import hashlib
from array import array
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

BITS_PER_KEY = 10  # about 1% false positives with HASHES probes
HASHES = 4
MIN_BITS = 1 << 10
MAX_BITS = 1 << 18  # 32 KiB: past ~26k cached blocks the false-positive rate grows


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """A full block's key: hash(parent key, its token ids, extra keys).

    NOTE: a cryptographic hash, not ``hash()``: a tenant who could craft a collision
    with another tenant's block would read that tenant's KV.
    """
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def cache_scope(tenant_id: str, cache_salt: str, adapter: str | None) -> bytes:
    """What a request's first block is keyed with besides its tokens: the prefix cache is
    shared only between requests of one tenant, salt and adapter."""
    return "\0".join((tenant_id, cache_salt, adapter or "")).encode()


def prompt_keys(token_ids: Sequence[int], block_size: int, scope: bytes,
                limit: int = 1 << 12) -> list[bytes]:
    """The keys of the prompt's blocks that a cache hit can cover, first block first (the
    engine recomputes the last token, so a prompt of exactly k blocks can hit k - 1)."""
    keys: list[bytes] = []
    parent = None
    for i in range(min((len(token_ids) - 1) // block_size, limit)):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                            scope if i == 0 else b"")
        keys.append(parent)
    return keys


def _probes(key: bytes, bits: int) -> Iterable[int]:
    # A key is a sha256 digest already: its 4-byte words are independent uniform probes.
    for i in range(HASHES):
        yield int.from_bytes(key[4 * i:4 * i + 4], "little") % bits


@dataclass(frozen=True, slots=True)
class PrefixSummary:
    """A Bloom filter of the cached blocks' keys, and the block size they were cut at."""

    block_size: int
    bits: int
    filter: bytes

    @classmethod
    def of(cls, keys: Collection[bytes], block_size: int) -> PrefixSummary:
        import numpy as np  # the engine builds it each heartbeat: tens of thousands of keys

        bits = MIN_BITS
        while bits < len(keys) * BITS_PER_KEY and bits < MAX_BITS:
            bits <<= 1
        table = np.zeros(bits // 8, dtype=np.uint8)
        if keys:
            words = np.frombuffer(b"".join(keys), dtype="<u4").reshape(len(keys), -1)
            probes = (words[:, :HASHES] % bits).ravel()
            np.bitwise_or.at(table, probes >> 3, (1 << (probes & 7)).astype(np.uint8))
        return cls(block_size, bits, table.tobytes())

    def __contains__(self, key: bytes) -> bool:
        return all(self.filter[p >> 3] >> (p & 7) & 1 for p in _probes(key, self.bits))

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks the engine holds (the first missing one
        ends the run: a chained key cannot hit after a miss)."""
        for i, key in enumerate(keys):
            if key not in self:
                return i
        return len(keys)

    def to_dict(self) -> dict[str, int | str]:
        return {"block_size": self.block_size, "bits": self.bits,
                "filter": base64.b64encode(self.filter).decode()}

    @classmethod
    def from_dict(cls, raw: object) -> PrefixSummary | None:
        """None when ``raw`` is not a well-formed summary (an engine of another version)."""
        if not isinstance(raw, dict):
            return None
        try:
            block_size, bits = int(raw["block_size"]), int(raw["bits"])
            table = base64.b64decode(raw["filter"], validate=True)
        except (KeyError, TypeError, ValueError):
            return None
        if block_size < 1 or not MIN_BITS <= bits <= MAX_BITS or len(table) * 8 != bits:
            return None
        return cls(block_size, bits, table)
