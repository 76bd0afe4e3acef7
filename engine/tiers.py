"""Service tiers in the scheduler (docs/tiers.md): who may take whose seat.

- "priority" runs ahead of "default"; an operator may keep ``reserve_seats`` of the
  engine's seats for it (`may_start`), and a priority sequence that still finds no seat,
  or no KV blocks for its prompt, takes them from the latest sequence of a lower tier
  (`seat_to_yield`); its own are preempted last (the scheduler's victim order).
- The spare tiers, "flex" then "batch" (protocol.SPARE_TIERS), run on spare capacity only:
  a default or priority sequence waiting for a seat or blocks takes them from the latest
  spare one, which waits and later runs again from its prefix cache; while such a sequence
  is starting (waiting, or not yet past its first token), spare sequences sit the step out
  (`interactive_starting`), so its prefill step is as short as it would be without them;
  and spare work takes at most SPARE_STEP_TOKENS of a step, so a step with spare work in it
  is short, and a request arriving meanwhile waits little for it to end.
"""

from __future__ import annotations

from engine import parallel, protocol
from engine.fair_queue import FairQueue
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence

SPARE_STEP_TOKENS = 32
_PRIORITY_RANK = protocol.TIERS.index(protocol.TIER_PRIORITY)
_FIRST_SPARE_RANK = min(protocol.TIERS.index(t) for t in protocol.SPARE_TIERS)


def is_spare(seq: Sequence) -> bool:
    return seq.tier in protocol.SPARE_TIERS


def interactive_starting(waiting: FairQueue, running: list[Sequence]) -> bool:
    best = waiting.best_rank()
    if best is not None and best[0] < _FIRST_SPARE_RANK:
        return True
    return any(not is_spare(s) and s.num_output_tokens == 0 for s in running)


def seat_limit(seq: Sequence, max_num_seqs: int, reserve_seats: int) -> int:
    """The seats the running batch may fill once ``seq`` starts: all of them for a
    priority sequence, all but the reserve for the others."""
    return max_num_seqs if seq.rank[0] == _PRIORITY_RANK else max_num_seqs - reserve_seats


def may_start(seq: Sequence, seats: int, max_num_seqs: int, reserve_seats: int) -> bool:
    """Whether ``seq`` may start beside running sequences that hold ``seats``."""
    return seats + parallel.seats(seq) <= seat_limit(seq, max_num_seqs, reserve_seats)


def seat_to_yield(waiting: FairQueue, running: list[Sequence], kv: KVCacheManager,
                  max_num_seqs: int, reserve_seats: int = 0) -> Sequence | None:
    """The running sequence to preempt now, when the next to wait is of a default or
    priority tier and cannot start for want of a seat or of its prompt's KV blocks: the
    latest of the lowest tier below it (a spare one first, a default one only for a
    priority sequence)."""
    if not waiting:
        return None
    head = waiting.peek()
    if is_spare(head):
        return None
    lower = [s for s in running if s.rank[0] > head.rank[0]]
    if not lower:
        return None
    seats = sum(parallel.seats(s) for s in running)
    short_of_blocks = kv.blocks_needed(head.num_tokens) > kv.num_free_blocks
    if not may_start(head, seats, max_num_seqs, reserve_seats) or short_of_blocks:
        return max(lower, key=lambda s: (s.rank[0], s.arrival))
    return None
