"""The prefix cache's second tier: KV blocks kept in host memory after the engine's pool
evicted them, found again by the same tenant-scoped block hashes and copied back instead of
recomputed.

Plain Python, no tensors: a slot here is only an index into the runner's host KV tensors
(ModelRunner.host_caches), and the copies are moves the runner makes:

- saved ahead (``keep``, device block -> host slot): a cached block the pool frees (no
  sequence holds it any more) is copied here while it sits in the pool's free queue, on
  the runner's copy thread beside the next step's forward pass (``take_ahead``): no step
  waits for it. The block is read, never written, until the pool hands it out again;
  the runner lets each step's copies finish before the next step starts.
- ``save`` (device block -> host slot), before the step's forward pass: a cached block the
  pool hands out again before its copy ahead was made (freed and reused in one step), or
  whose copy here was given up since; read before the step that reuses it writes into it;
- ``load`` (host slot -> device block), before the step's forward pass: a prefix found here
  for a sequence about to run; the block is in the pool's cache index from then on, as if
  computed;
- ``restore`` (host slot -> device block), beside the step's forward pass: the same for a
  sequence that waits for it while others run, and starts at the next step (the slot is
  pinned until the copy is handed to the step).

Those before the forward pass run in the order they were decided (``take_moves``). A block
stays here after it is loaded back (the tier holds copies, not the only one), so evicting
it from the pool again costs no copy.

Fair between tenants: a tenant's share of the slots is its weight (the plan's fair weight,
as the scheduler's) over the weights of the tenants that have blocks here. When the tier is
full, the slot given up is the least recently used one of the tenant most over its share,
so a tenant saving blocks by the thousand evicts its own once it holds its share, never the
share of another. A block whose request asked it be kept (``prompt_cache_retention``
"24h": ``retention_s``) goes after its tenant's other blocks until it has gone unused that
long, and not at all while its tenant is within its share (past it, retention protects
nothing beyond the order). No lookup crosses tenants: the key of a prompt's first block
holds its cache scope (tenant, salt, adapter) and every later key chains it
(engine/prefix_hash.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

SAVE, LOAD = "save", "load"


@dataclass(slots=True)
class HostKVStats:
    saves: int = 0  # blocks copied here from the pool
    loads: int = 0  # blocks copied back into the pool (restores)
    evictions: int = 0  # blocks given up here to make room
    queries: int = 0  # prompt tokens looked up here (those the pool did not hold)
    hits: int = 0  # of those, found here


@dataclass(slots=True, eq=False)
class _Entry:
    slot: int
    tenant: str
    retention_s: float = 0.0  # kept ahead of others this long after its last use
    kept_until: float = 0.0  # (the tier's clock)
    pinned: int = 0  # sequences about to load it: not given up meanwhile


class HostKVTier:
    def __init__(self, num_slots: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if num_slots < 1:
            raise ValueError("the host KV tier needs at least one slot")
        self.num_slots = num_slots
        self._clock = clock
        self._free = list(range(num_slots - 1, -1, -1))
        self._index: dict[bytes, _Entry] = {}
        # Each tenant's keys, least recently used first; and each tenant's weight.
        self._by_tenant: dict[str, OrderedDict[bytes, None]] = {}
        self._weights: dict[str, float] = {}
        self._moves: list[tuple[str, int, int]] = []
        # Copies ahead not yet handed to a step: block hash -> (pool block, slot); and loads
        # beside the step, with the blocks they read (pinned until then).
        self._ahead: dict[bytes, tuple[int, int]] = {}
        self._restores: list[tuple[str, int, int]] = []
        self._restoring: list[bytes] = []
        self.stats = HostKVStats()

    @property
    def num_used(self) -> int:
        return len(self._index)

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def used_by(self, tenant: str) -> int:
        return len(self._by_tenant.get(tenant, ()))

    # --- the pool's evictions ----------------------------------------------------------------

    def keep(self, block_id: int, block_hash: bytes, tenant: str, weight: float = 1.0,
             retention_s: float = 0.0) -> None:
        """Pool block ``block_id`` is free and still cached: its content is copied here ahead
        of its eviction, off the step's path (``take_ahead``); nothing to copy when it is
        here already."""
        if block_hash in self._index:
            self._touch(block_hash, retention_s)
            return
        slot = self._take_slot(block_hash, tenant, weight, retention_s)
        if slot is not None:
            self._ahead[block_hash] = (block_id, slot)

    def save(self, block_id: int, block_hash: bytes, tenant: str, weight: float = 1.0,
             retention_s: float = 0.0) -> None:
        """Pool block ``block_id`` is about to be reused: its content is copied here before
        the step writes into it, unless a copy is here already (saved ahead, or loaded from
        here); a copy ahead not yet handed to a step is made now instead."""
        if block_hash in self._index:
            self._touch(block_hash, retention_s)
            ahead = self._ahead.pop(block_hash, None)
            if ahead is not None:
                self._moves.append((SAVE, *ahead))
            return
        slot = self._take_slot(block_hash, tenant, weight, retention_s)
        if slot is not None:
            self._moves.append((SAVE, block_id, slot))

    def _take_slot(self, block_hash: bytes, tenant: str, weight: float,
                   retention_s: float) -> int | None:
        """A slot for a block to be copied here, indexed from now on; None when every slot
        is pinned by a load this step (the block is not kept)."""
        self._weights[tenant] = weight
        slot = self._free.pop() if self._free else self._give_up_one(tenant)
        if slot is None:
            return None
        self._index[block_hash] = _Entry(slot, tenant)
        self._by_tenant.setdefault(tenant, OrderedDict())[block_hash] = None
        self._touch(block_hash, retention_s)
        self.stats.saves += 1
        return slot

    def _give_up_one(self, saver: str) -> int | None:
        """The slot of the least recently used unpinned block of the tenant most over its
        share (the saver counted as holding one more); its kept ones (retention) last, and
        not at all while it is within its share, but as a last resort."""
        held = {t: len(keys) + (t == saver) for t, keys in self._by_tenant.items()}
        total = sum(self._weights.get(t, 1.0) for t in {*held, saver})
        ranked = sorted(held, key=lambda t: held[t] / self._weights.get(t, 1.0), reverse=True)
        now = self._clock()
        for last_resort in (False, True):
            for tenant in ranked:
                within = held[tenant] <= self.num_slots * self._weights.get(tenant, 1.0) / total
                kept, plain = [], []
                for block_hash in self._by_tenant[tenant]:
                    entry = self._index[block_hash]
                    if not entry.pinned:
                        (kept if entry.kept_until > now else plain).append(block_hash)
                        if plain:
                            break  # the least recently used ordinary one: it goes
                choice = plain or (kept if last_resort or not within else [])
                if choice:
                    slot = self._index[choice[0]].slot
                    self._forget(choice[0])
                    self.stats.evictions += 1
                    return slot
        return None

    # --- a sequence's prefix -----------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> int:
        """How many of ``hashes`` (chained keys, in order) are here, from the first on."""
        found = 0
        for block_hash in hashes:
            if block_hash not in self._index:
                break
            found += 1
        return found

    def pin(self, hashes: list[bytes], delta: int = 1) -> None:
        """Holds (``delta`` 1) or lets go of (-1) blocks a sequence is about to load."""
        for block_hash in hashes:
            self._index[block_hash].pinned += delta

    def load(self, block_hash: bytes, block_id: int) -> None:
        """Copies the block kept under ``block_hash`` into pool block ``block_id`` before
        the step's forward pass."""
        self._moves.append(self._read(block_hash, block_id))

    def restore(self, block_hash: bytes, block_id: int) -> None:
        """Copies the block kept under ``block_hash`` into pool block ``block_id`` beside the
        step's forward pass (``take_ahead``), for a sequence that starts at a later step;
        the block stays pinned until the copy is handed to the step."""
        self.pin([block_hash])
        self._restoring.append(block_hash)
        self._restores.append(self._read(block_hash, block_id))

    def _read(self, block_hash: bytes, block_id: int) -> tuple[str, int, int]:
        """The move that copies ``block_hash``'s slot into pool block ``block_id``."""
        self._touch(block_hash)
        self.stats.loads += 1
        return LOAD, self._index[block_hash].slot, block_id

    def record_lookup(self, tokens: int, found: int) -> None:
        self.stats.queries += tokens
        self.stats.hits += found

    # --- the runner's side -------------------------------------------------------------------

    def take_moves(self) -> list[tuple[str, int, int]]:
        """This step's copies, in the order they must run: (SAVE, block, slot) and
        (LOAD, slot, block)."""
        moves, self._moves = self._moves, []
        return moves

    def take_ahead(self) -> list[tuple[str, int, int]]:
        """The copies made beside this step's forward pass: restores (LOAD, slot, block)
        into blocks no request of the step reads, then copies ahead (SAVE, block, slot) of
        blocks free in the pool, which the step does not write into. None of them touches
        another's block or slot: a restore's slot is pinned, a restore's block was just
        handed out (a copy ahead of it became a save before the step)."""
        ahead = self._restores + [(SAVE, block, slot) for block, slot in self._ahead.values()]
        for block_hash in self._restoring:
            if block_hash in self._index:
                self._index[block_hash].pinned -= 1
        self._ahead.clear()
        self._restores, self._restoring = [], []
        return ahead

    def reset(self) -> None:
        """Forgets every block (a forward pass failed: what a save read may be wrong)."""
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._index.clear()
        self._by_tenant.clear()
        self._moves.clear()
        self._ahead.clear()
        self._restores, self._restoring = [], []

    def _touch(self, block_hash: bytes, retention_s: float = 0.0) -> None:
        """Used now: the most recently used of its tenant's, kept ahead of others for its
        retention from now (the longest any of its requests asked)."""
        entry = self._index[block_hash]
        self._by_tenant[entry.tenant].move_to_end(block_hash)
        entry.retention_s = max(entry.retention_s, retention_s)
        entry.kept_until = self._clock() + entry.retention_s

    def _forget(self, block_hash: bytes) -> None:
        entry = self._index.pop(block_hash)
        self._ahead.pop(block_hash, None)  # its slot goes to another block: no copy into it
        keys = self._by_tenant[entry.tenant]
        del keys[block_hash]
        if not keys:
            del self._by_tenant[entry.tenant]
            self._weights.pop(entry.tenant, None)
