"""The pool of physical KV blocks: reference counts, a free queue, and the prefix-cache index.

Plain Python, no tensors: a block here is only an id into the runner's KV tensors.

A block with no reference sits in the free queue, oldest release first. If it holds a
full, hashed block of some prompt it also stays in the cache index until it is
handed out again, so a later request with the same prefix can take it back: the
free queue is therefore also the least-recently-used eviction order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The tenant whose prompt a cached block holds, its weight, and the seconds of disuse its
# request asked the block be kept ahead of others (prompt_cache_retention; 0: none).
Owner = tuple[str, float, float]


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and in the cache index
    owner: Owner = ("", 1.0, 0.0)  # who cached it


# Told of each cached block the pool hands out again, before its content is overwritten:
# (block id, its hash, then its owner's three). The host tier keeps a copy (host_kv.py).
EvictionHook = Callable[[int, bytes, str, float, float], None]


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # NOTE: holds exactly the blocks with ref_cnt == 0, least recently released first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self.on_evict: EvictionHook | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached-but-unused ones included."""
        return len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        """``n`` blocks, each with one reference; evicts cached blocks as needed."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # evict: its content is about to be overwritten
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash, *block.owner)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def cached_keys(self) -> list[bytes]:
        """The keys of every block in the cache index (the heartbeat's prefix summary)."""
        return list(self._cached)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Takes a reference on blocks found in the cache (out of the free queue if unused)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drops one reference each; the last one puts the block at the back of the free queue.

        Callers pass a sequence's blocks tail first, so a prompt's last blocks are evicted
        before its first ones, which more requests share.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
            elif block.ref_cnt < 0:
                raise RuntimeError(f"KV block {block.block_id} released more than taken")

    def cache(self, block: KVBlock, block_hash: bytes, owner: Owner = ("", 1.0, 0.0)) -> None:
        """Indexes a full block under its hash, unless an equal block is indexed already;
        ``owner``: the tenant whose prompt it holds (Owner).

        NOTE: a hashed block is never written again: only full blocks are hashed, and a
        sequence only writes positions past those it has computed.
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.owner = owner
        self._cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None

    def reset_cache(self) -> None:
        """Forgets every cached block (content stays; the index goes)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
