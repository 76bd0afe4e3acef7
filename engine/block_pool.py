"""The pool of physical KV blocks: reference counts, the free blocks, and the prefix-cache index.

Plain Python, no tensors: a block here is only an id into the runner's KV tensors.

A block with no reference is free. If it holds a full, hashed block of some prompt it also
stays in the cache index until it is handed out again, so a later request with the same
prefix can take it back. Handing out picks, first, a free block that caches nothing; then
a cached one, evicting it: the least recently released of the tenant whose cached blocks
most exceed its share (its weight over the weights of the tenants with cached blocks), so a
tenant cycling through many prompts evicts its own blocks, not another tenant's cached
prefix. Within a tenant, eviction is least recently released first.
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


# Told of a cached block: (block id, its hash, then its owner's three). The host tier keeps
# a copy (host_kv.py) of each one freed (on_release) and of each handed out again before its
# content is overwritten (on_evict).
BlockHook = Callable[[int, bytes, str, float, float], None]


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # NOTE: together they hold exactly the blocks with ref_cnt == 0, each least recently
        # released first: those that cache nothing, and the cached ones by owner.
        self._plain: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._kept: dict[str, OrderedDict[int, KVBlock]] = {}
        self._num_free = num_blocks
        self._cached: dict[bytes, KVBlock] = {}
        self._held: dict[str, int] = {}  # cached blocks by owner, in use or free
        self._weights: dict[str, float] = {}
        self.on_evict: BlockHook | None = None
        self.on_release: BlockHook | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached-but-unused ones included."""
        return self._num_free

    def allocate(self, n: int) -> list[KVBlock]:
        """``n`` blocks, each with one reference; evicts cached blocks as needed."""
        if n > self._num_free:
            raise MemoryError(f"asked for {n} KV blocks, {self._num_free} free")
        out = []
        for _ in range(n):
            block = self._take_one()
            if block.block_hash is not None:  # evict: its content is about to be overwritten
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash, *block.owner)
                self._unindex(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _take_one(self) -> KVBlock:
        if self._plain:
            _, block = self._plain.popitem(last=False)
        else:
            # NOTE: at an even ratio the tenant holding more gives a block up.
            tenant = max(self._kept, key=lambda t: (self._held[t] / self._weights[t],
                                                    self._held[t]))
            _, block = self._kept[tenant].popitem(last=False)
            if not self._kept[tenant]:
                del self._kept[tenant]
        self._num_free -= 1
        return block

    def cached_keys(self) -> list[bytes]:
        """The keys of every block in the cache index (the heartbeat's prefix summary)."""
        return list(self._cached)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Takes a reference on blocks found in the cache (no longer free if unused)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._unfree(block)
            block.ref_cnt += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drops one reference each; the last one frees the block, as the most recently
        released.

        Callers pass a sequence's blocks tail first, so a prompt's last blocks are evicted
        before its first ones, which more requests share.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free(block)
                if block.block_hash is not None and self.on_release is not None:
                    self.on_release(block.block_id, block.block_hash, *block.owner)
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
        free = block.ref_cnt == 0
        if free:
            self._unfree(block)
        block.block_hash = block_hash
        block.owner = owner
        self._cached[block_hash] = block
        self._held[owner[0]] = self._held.get(owner[0], 0) + 1
        self._weights[owner[0]] = owner[1]
        if free:
            self._free(block)

    def uncache(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        free = block.ref_cnt == 0
        if free:
            self._unfree(block)
        self._unindex(block)
        if free:
            self._free(block)

    def reset_cache(self) -> None:
        """Forgets every cached block (content stays; the index goes)."""
        for block in list(self._cached.values()):
            self.uncache(block)

    def _unindex(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        block.block_hash = None
        tenant = block.owner[0]
        self._held[tenant] -= 1
        if not self._held[tenant]:
            del self._held[tenant]
            self._weights.pop(tenant, None)

    def _free(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self._plain[block.block_id] = block
        else:
            self._kept.setdefault(block.owner[0], OrderedDict())[block.block_id] = block
        self._num_free += 1

    def _unfree(self, block: KVBlock) -> None:
        if block.block_hash is None:
            del self._plain[block.block_id]
        else:
            kept = self._kept[block.owner[0]]
            del kept[block.block_id]
            if not kept:
                del self._kept[block.owner[0]]
        self._num_free -= 1
