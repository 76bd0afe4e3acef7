"""The batch priority class (the Batch API's requests, protocol.BATCH_PRIORITY) runs on
spare capacity only; the scheduler asks these two questions each step (docs/batches.md).

- An interactive sequence waiting for a seat, or for KV blocks, takes them from the
  latest batch sequence (`seat_to_yield`), which waits and later runs again from its
  prefix cache.
- While an interactive sequence is starting (waiting, or not yet past its first token),
  batch sequences sit the step out (`interactive_starting`): its prefill step is as short
  as it would be without them; the batch decodes in the steps between.
- Batch work takes at most BATCH_STEP_TOKENS of a step, so a step with batch work in it
  is short, and an interactive request arriving meanwhile waits little for it to end.
"""

from __future__ import annotations

from engine import parallel, protocol
from engine.fair_queue import FairQueue
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence

BATCH_STEP_TOKENS = 32


def is_batch(seq: Sequence) -> bool:
    return seq.priority >= protocol.BATCH_PRIORITY


def interactive_starting(waiting: FairQueue, running: list[Sequence]) -> bool:
    best = waiting.best_priority()
    if best is not None and best < protocol.BATCH_PRIORITY:
        return True
    return any(not is_batch(s) and s.num_output_tokens == 0 for s in running)


def seat_to_yield(waiting: FairQueue, running: list[Sequence], kv: KVCacheManager,
                  max_num_seqs: int) -> Sequence | None:
    """The batch sequence to preempt now: the latest, when an interactive one waits for a
    seat or for the KV blocks of its prompt."""
    best = waiting.best_priority()
    if best is None or best >= protocol.BATCH_PRIORITY:
        return None
    batch = [s for s in running if is_batch(s)]
    if not batch:
        return None
    head = waiting.peek()
    seats = sum(parallel.seats(s) for s in running)
    short_of_blocks = kv.blocks_needed(head.num_tokens) > kv.num_free_blocks
    if seats + parallel.seats(head) > max_num_seqs or short_of_blocks:
        return max(batch, key=lambda s: s.arrival)
    return None
