"""Block tables per sequence on top of the block pool, and prefix-cache lookups.

Plain Python, no tensors. The scheduler asks for room (``allocate_slots``) before it
schedules tokens, looks up cached prefixes (``get_computed_blocks``) for a sequence
that is about to start, and hands blocks back (``free``) when it preempts or ends one.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool, KVBlock, Owner
from engine.host_kv import HostKVTier
from engine.prefix_hash import hash_block
from engine.sequence import Sequence

# A cached prefix: blocks of the pool, then the hashes of blocks the host tier holds (loaded
# back into fresh blocks when the sequence takes its prefix, ``allocate_slots``).
CachedPrefix = list[KVBlock | bytes]


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted once per request, when its prompt is first admitted
    (`KVCacheManager.record_prefix_lookup`)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, *, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, host_blocks: int = 0) -> None:
        """``host_blocks``: the host tier's size in blocks (0: no host tier)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.host = HostKVTier(host_blocks) if host_blocks and enable_prefix_caching else None
        if self.host is not None:
            self.pool.on_evict = self.host.save
            self.pool.on_release = self.host.keep
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[KVBlock]] = {}
        self.stats = PrefixCacheStats()
        # Copy-on-write this step, destination block id -> source block id (take_copies).
        self._copies: dict[int, int] = {}
        # Waiting sequences whose prefix is being restored from the host tier beside a step
        # (restore_ahead): the blocks each holds until it starts, and those the next step
        # indexes once their copy has been handed to a step.
        self._reserved: dict[str, list[KVBlock]] = {}
        self._to_index: dict[str, tuple[Owner, list[tuple[KVBlock, bytes]]]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def record_prefix_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's prompt was looked up in the prefix cache on its first admission."""
        self.stats.queries += prompt_tokens
        self.stats.hits += cached_tokens

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-unused blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self.tables.get(seq.request_id, ())]

    def get_computed_blocks(self, seq: Sequence) -> tuple[CachedPrefix, int]:
        """The longest cached prefix of ``seq`` in whole blocks (the pool's, then those the
        host tier holds past them), and how many tokens it covers.

        At least one token is always left to compute, so the step that finishes the
        prompt has logits to sample from.

        NOTE: a sequence still gathering prompt logprobs finds nothing: each prompt
        position's logits are needed, and a cached position is never run. Its blocks are
        still cached for others (``cache_full_blocks``); once it has them all (a preempted
        one readmitted), it reads the cache like any other. Nor does an embedding input:
        mean pooling sums the hidden state of every position and cls pooling takes the
        first's, and a cached position's is never computed.
        """
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs \
                or seq.embedding is not None:
            return [], 0
        self._hash_full_blocks(seq, (seq.num_tokens - 1) // self.block_size)
        hashes = seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]
        hits: CachedPrefix = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.host is not None:
            rest = hashes[len(hits):]
            hits += rest[:self.host.lookup(rest)]
        return hits, len(hits) * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: CachedPrefix | None = None) -> bool:
        """Makes room for ``num_new_tokens`` more tokens of ``seq``; False if the pool is short.

        ``computed`` is the cached prefix of a sequence that holds no blocks yet (it starts:
        ``get_computed_blocks``); it comes first in its table, the host tier's blocks loaded
        into fresh ones of the pool.
        """
        table = self.tables.get(seq.request_id, [])
        hits = [b for b in computed or () if isinstance(b, KVBlock)]
        kept = [h for h in computed or () if isinstance(h, bytes)]  # in the host tier
        if computed and table:
            raise ValueError("cache hits are only taken by a sequence that holds no blocks")
        num_computed = seq.num_computed_tokens + len(computed or ()) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(table) \
            - len(computed or ())
        # NOTE: a block other choices of the request hold too (fork) is copied before this
        # sequence writes into it. Only a partly filled one can be: a full block is never
        # written again.
        shared = [i for i in range(seq.num_computed_tokens // self.block_size, len(table))
                  if table[i].ref_cnt > 1]
        # Hits sitting unused in the free queue stop being free once taken.
        available = self.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0)
        if max(need, 0) + len(kept) + len(shared) > available:
            return False
        self.pool.touch(hits)
        for i in shared:
            table[i] = self._copy_on_write(table[i])
        table = table + hits + self._load(seq, kept) + self.pool.allocate(max(need, 0))
        self.tables[seq.request_id] = table
        reserved = self._reserved.pop(seq.request_id, None)
        if computed is not None and reserved is None:  # (a restore counted its own lookup)
            self._count_host_lookup(seq, hits, kept)
        self.pool.release((reserved or [])[::-1])  # its table holds them now
        return True

    def restore_ahead(self, seq: Sequence, computed: CachedPrefix) -> bool:
        """Starts bringing back the part of ``seq``'s cached prefix the host tier holds, into
        fresh pool blocks, beside this step's forward pass: ``seq`` waits, holding its
        prefix's blocks, and at the next step finds it all in the pool. False (nothing done)
        when none of it is in the host tier, it is already on its way, or the pool has no
        room for it now (the sequence then starts as it can, loading before the step)."""
        kept = [h for h in computed if isinstance(h, bytes)]
        if not kept or seq.request_id in self._reserved:
            return False
        assert self.host is not None
        hits = [b for b in computed if isinstance(b, KVBlock)]
        if len(kept) > self.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0):
            return False
        self.pool.touch(hits)
        blocks = self._blocks_for(kept)
        for block, block_hash in zip(blocks, kept, strict=True):
            self.host.restore(block_hash, block.block_id)
        self._reserved[seq.request_id] = hits + blocks
        self._to_index[seq.request_id] = (_owner(seq), list(zip(blocks, kept, strict=True)))
        self._count_host_lookup(seq, hits, kept)
        return True

    def index_restored(self) -> None:
        """At a step's start: the blocks restored beside the last step enter the pool's
        cache index, as if computed (the runner finishes those copies before this step's
        forward pass reads anything)."""
        for owner, restored in self._to_index.values():
            for block, block_hash in restored:
                self.pool.cache(block, block_hash, owner)
        self._to_index.clear()

    def _count_host_lookup(self, seq: Sequence, hits: list[KVBlock], kept: list[bytes]) -> None:
        """The host tier's share of a prompt's first lookup: the tokens the pool did not
        hold, and those found there."""
        if self.host is not None and not seq.num_preemptions:
            self.host.record_lookup((seq.num_prompt_tokens - len(hits) * self.block_size),
                                    len(kept) * self.block_size)

    def _blocks_for(self, kept: list[bytes]) -> list[KVBlock]:
        """Fresh pool blocks for the host tier's ``kept`` ones to be copied into."""
        assert self.host is not None
        # NOTE: held while the pool makes room: a block the pool evicts now is saved to the
        # host tier, and that save must not take the slot of one about to be copied back.
        self.host.pin(kept)
        try:
            return self.pool.allocate(len(kept))
        finally:
            self.host.pin(kept, -1)

    def _load(self, seq: Sequence, kept: list[bytes]) -> list[KVBlock]:
        """Fresh pool blocks for the host tier's ``kept`` ones, each loaded from there and
        cached under its hash, as if computed here."""
        if not kept:
            return []
        blocks = self._blocks_for(kept)
        for block, block_hash in zip(blocks, kept, strict=True):
            self.host.load(block_hash, block.block_id)
            self.pool.cache(block, block_hash, _owner(seq))
        return blocks

    def snapshot(self) -> dict[str, int | float]:
        """The pool's and the host tier's figures (the engine's heartbeat and metrics)."""
        figures: dict[str, int | float] = {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_blocks - self.num_free_blocks,
            "kv_blocks_free": self.num_free_blocks, "kv_usage": self.usage,
            "prefix_cache_queries": self.stats.queries, "prefix_cache_hits": self.stats.hits,
            "prefix_cache_hit_rate": round(self.stats.hit_rate, 4)}
        if self.host is not None:
            host = self.host.stats
            figures.update(
                kv_host_blocks_total=self.host.num_slots, kv_host_blocks_used=self.host.num_used,
                kv_host_saves=host.saves, kv_host_loads=host.loads,
                kv_host_evictions=host.evictions, external_prefix_cache_queries=host.queries,
                external_prefix_cache_hits=host.hits)
        return figures

    def take_host_moves(self) -> list[tuple[str, int, int]]:
        """The copies between the pool and the host tier this step's forward pass needs
        first, in order (HostKVTier.take_moves)."""
        return self.host.take_moves() if self.host is not None else []

    def take_host_ahead(self) -> list[tuple[str, int, int]]:
        """The copies into the host tier of blocks the pool has freed, which the runner makes
        beside this step's forward pass (HostKVTier.take_ahead)."""
        return self.host.take_ahead() if self.host is not None else []

    def reset_cache(self) -> None:
        """Forgets every cached block, in both tiers (a forward pass failed)."""
        self.pool.reset_cache()
        self._to_index.clear()  # what a restore brought back is not trusted either
        if self.host is not None:
            self.host.reset()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (another choice of ``parent``'s request) shares every block of
        ``parent``'s table, one more reference each, until it writes into one."""
        table = self.tables[parent.request_id]
        self.pool.touch(table)
        self.tables[child.request_id] = list(table)
        child.block_hashes = list(parent.block_hashes)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies this step's writes need, once each.

        NOTE: a destination freed and handed out again in the same step appears once, with
        its last source; a source is never a destination in the same step (it was shared,
        a block allocated this step is not).
        """
        copies = [(src, dst) for dst, src in self._copies.items()]
        self._copies.clear()
        return copies

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Indexes the blocks that the first ``num_tokens`` tokens of ``seq`` fill.

        The scheduler calls it for the tokens it has just scheduled, so a request admitted
        later in the same step already hits them. NOTE: that is safe because each layer
        writes the whole step's keys and values before any attention reads the cache.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        table = self.tables.get(seq.request_id, [])
        self._hash_full_blocks(seq, num_full)
        for block, block_hash in zip(table[:num_full], seq.block_hashes, strict=False):
            self.pool.cache(block, block_hash, _owner(seq))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the blocks past the first ``num_tokens`` positions of ``seq``: room
        taken for speculated tokens the model rejected. None of them is in the index."""
        table = self.tables.get(seq.request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return
        self.pool.release(table[keep:][::-1])
        del table[keep:]

    def free(self, seq: Sequence) -> None:
        self._to_index.pop(seq.request_id, None)
        self.pool.release(self._reserved.pop(seq.request_id, [])[::-1])
        table = self.tables.pop(seq.request_id, [])
        # Blocks indexed for a step that never ran hold no valid KV: take them out of the
        # index (a sequence preempted or failed before its step computed them).
        for block in table[seq.num_computed_tokens // self.block_size:]:
            self.pool.uncache(block)
        self.pool.release(table[::-1])

    def _copy_on_write(self, block: KVBlock) -> KVBlock:
        (copy,) = self.pool.allocate(1)
        self.pool.release([block])
        self._copies[copy.block_id] = block.block_id
        return copy

    def _hash_full_blocks(self, seq: Sequence, num_full: int) -> None:
        size = self.block_size
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[i - 1] if i else None
            extra = seq.cache_scope if i == 0 else b""
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * size:(i + 1) * size],
                                               extra))


def _owner(seq: Sequence) -> Owner:
    return seq.tenant_id, seq.fair_weight, seq.cache_retention_s
