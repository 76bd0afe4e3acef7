"""Block tables per sequence on top of the block pool, and prefix-cache lookups.

Plain Python, no tensors. The scheduler asks for room (``allocate_slots``) before it
schedules tokens, looks up cached prefixes (``get_computed_blocks``) for a sequence
that is about to start, and hands blocks back (``free``) when it preempts or ends one.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool, KVBlock
from engine.prefix_hash import hash_block
from engine.sequence import Sequence


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
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[KVBlock]] = {}
        self.stats = PrefixCacheStats()
        # Copy-on-write this step, destination block id -> source block id (take_copies).
        self._copies: dict[int, int] = {}

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

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``seq`` in whole blocks, and how many tokens it covers.

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
        hits = []
        for block_hash in seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: list[KVBlock] | None = None) -> bool:
        """Makes room for ``num_new_tokens`` more tokens of ``seq``; False if the pool is short.

        ``computed`` are cache hits for a sequence that holds no blocks yet; they come
        first in its table.
        """
        table = self.tables.get(seq.request_id, [])
        computed = computed or []
        if computed and table:
            raise ValueError("cache hits are only taken by a sequence that holds no blocks")
        num_computed = seq.num_computed_tokens + len(computed) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(computed)
        # NOTE: a block other choices of the request hold too (fork) is copied before this
        # sequence writes into it. Only a partly filled one can be: a full block is never
        # written again.
        shared = [i for i in range(seq.num_computed_tokens // self.block_size, len(table))
                  if table[i].ref_cnt > 1]
        # Hits sitting unused in the free queue stop being free once taken.
        available = self.pool.num_free - sum(1 for b in computed if b.ref_cnt == 0)
        if max(need, 0) + len(shared) > available:
            return False
        self.pool.touch(computed)
        for i in shared:
            table[i] = self._copy_on_write(table[i])
        table = table + computed + self.pool.allocate(max(need, 0))
        self.tables[seq.request_id] = table
        return True

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
            self.pool.cache(block, block_hash)

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
