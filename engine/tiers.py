"""Service tiers in the scheduler (docs/tiers.md): who may take whose seat.

- "priority" runs ahead of "default"; an operator may keep ``reserve_seats`` of the
  engine's seats for it (`may_start`), and a priority sequence that still finds no seat,
  or no KV blocks for its prompt, takes them from the latest sequence of a lower tier
  (`seat_to_yield`); its own are preempted last (the scheduler's victim order).
- Within a tier, under token-fair scheduling, a sequence finding no seat takes one from
  the tenant most over its share of the seats (`over_seat_share`).
- The spare tiers, "flex" then "batch" (protocol.SPARE_TIERS), run on spare capacity only:
  a default or priority sequence waiting for a seat or blocks takes them from the latest
  spare one, which waits and later runs again from its prefix cache; while such a sequence
  is starting (waiting, or not yet past its first token), batch sequences and flex prompts
  sit the step out (`interactive_starting`, `sits_out`), so its prefill step is about as
  short as it would be without them (flex decodes go on); and spare work takes at most
  SPARE_STEP_TOKENS of a step, so a step with spare work in it is short, and a request
  arriving meanwhile waits little for it to end.
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


def sits_out(seq: Sequence) -> bool:
    """Whether running ``seq`` sits out a step in which a default or priority sequence
    starts: batch work does, and a flex prompt; a flex request's decode goes on (within
    SPARE_STEP_TOKENS), so flex keeps making tokens where default requests start often."""
    return seq.tier == protocol.TIER_BATCH or (is_spare(seq) and seq.num_uncomputed > 1)


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


def next_to_start(waiting: FairQueue, running: list[Sequence], kv: KVCacheManager,
                  max_num_seqs: int, reserve_seats: int, budget: int, *, chunked: bool,
                  spare_sits_out: bool) -> list[Sequence]:
    """The waiting sequences that would start this step if running prompt chunks left them
    the budget, in the queue's order: while they have seats, KV blocks free for their
    prompts and ``budget`` for them (whole prompts, without chunked prefill); an adapter's
    sequence, or spare work sitting the step out, ends the walk."""
    seats = sum(parallel.seats(s) for s in running)
    out, tokens, blocks = [], 0, 0
    for seq in waiting.candidates():
        need = seq.num_tokens if not chunked else min(seq.num_tokens, budget - tokens)
        blocks += kv.blocks_needed(seq.num_tokens)
        if need <= 0 or tokens + need > budget or blocks > kv.num_free_blocks \
                or not may_start(seq, seats, max_num_seqs, reserve_seats) \
                or seq.adapter_hash is not None or (spare_sits_out and is_spare(seq)):
            break
        out.append(seq)
        seats += parallel.seats(seq)
        tokens += need
    return out


def seat_to_yield(waiting: FairQueue, running: list[Sequence], kv: KVCacheManager,
                  max_num_seqs: int, reserve_seats: int = 0, *,
                  seats_by_share: bool = False) -> Sequence | None:
    """The running sequence to preempt now, when the next to wait is of a default or
    priority tier and cannot start for want of a seat or of its prompt's KV blocks: the
    latest of the lowest tier below it (a spare one first, a default one only for a
    priority sequence); else, with ``seats_by_share`` and for want of a seat, one of its
    own tier's (`over_seat_share`)."""
    if not waiting:
        return None
    head = waiting.peek()
    if is_spare(head):
        return None
    seats = sum(parallel.seats(s) for s in running)
    no_seat = not may_start(head, seats, max_num_seqs, reserve_seats)
    lower = [s for s in running if s.rank[0] > head.rank[0]]
    if lower and (no_seat or kv.blocks_needed(head.num_tokens) > kv.num_free_blocks):
        return max(lower, key=lambda s: (s.rank[0], s.arrival))
    if no_seat and seats_by_share:
        return over_seat_share(head, running, max_num_seqs)
    return None


def over_seat_share(head: Sequence, running: list[Sequence], max_num_seqs: int
                    ) -> Sequence | None:
    """The latest running sequence of ``head``'s tier (of a plan priority no higher) whose
    tenant holds more than its share of the seats, when ``head``'s tenant holds less than
    its own: shares are the seats split by fair weight among the tenants running and
    ``head``'s. A tenant keeping many long requests in flight cannot hold the seats other
    tenants' requests wait for; it keeps at least its share, so two tenants never take a
    seat back and forth."""
    held: dict[str, int] = {}
    weight = {head.tenant_id: head.fair_weight}
    for seq in running:
        held[seq.tenant_id] = held.get(seq.tenant_id, 0) + parallel.seats(seq)
        weight[seq.tenant_id] = seq.fair_weight
    per_weight = max_num_seqs / sum(weight.values())
    if held.get(head.tenant_id, 0) + parallel.seats(head) > per_weight * head.fair_weight:
        return None
    over = [s for s in running if s.rank[0] == head.rank[0] and s.rank >= head.rank
            and s.tenant_id != head.tenant_id
            and held[s.tenant_id] - parallel.seats(s) >= per_weight * weight[s.tenant_id]]
    if not over:
        return None
    return max(over, key=lambda s: (held[s.tenant_id] / weight[s.tenant_id], s.arrival))
