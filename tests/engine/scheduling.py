"""Helpers for tests of the scheduler and KV manager alone: sequences and a fake runner."""

from __future__ import annotations

import itertools
from collections import Counter

from engine import protocol
from engine.batch import RunnerOutput, SchedulerOutput
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

_ids = itertools.count()


def seq(prompt_len: int = 8, *, tenant: str = "t1", max_tokens: int = 4, priority: int = 0,
        scope: bytes = b"t1", prompt: list[int] | None = None,
        tier: str = protocol.TIER_DEFAULT, weight: float = 1.0, **params) -> Sequence:
    n = next(_ids)
    # Distinct prompts by default, so sequences share a prefix only when a test says so.
    tokens = prompt if prompt is not None else [(7 * i + 3 * n) % 997 for i in range(prompt_len)]
    return Sequence(request_id=f"s{n}", token_ids=list(tokens),
                    num_prompt_tokens=len(tokens),
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                    seed=0, tenant_id=tenant, priority=priority, cache_scope=scope,
                    tier=tier, fair_weight=weight)


def scheduler(*, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
              budget: int = 32, max_model_len: int = 1024, chunked: bool = True,
              caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size,
                        enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, enable_chunked_prefill=chunked)


def fake_tokens(batch: SchedulerOutput) -> RunnerOutput:
    """What a runner would return: a token for every request that samples."""
    return RunnerOutput([100 + r.num_output_tokens if r.sample else None
                         for r in batch.requests])


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> dict[str, list]:
    """Steps until nothing is left; every output per request, in order."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outputs
        batch = sched.schedule()
        check_invariants(sched, batch)
        for out in sched.postprocess(batch, fake_tokens(batch)):
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the scheduler did not finish: a deadlock or livelock")


def check_invariants(sched: Scheduler, batch: SchedulerOutput) -> None:
    kv = sched.kv
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    # Each block's reference count is the number of block tables holding it: a leak (a
    # count too high) or a double free (too low, or a held block back on the free list)
    # shows here the step it happens.
    holders = Counter(id(b) for table in kv.tables.values() for b in table)
    blocks = {id(b): b for table in kv.tables.values() for b in table}
    for block_id, tables in holders.items():
        assert blocks[block_id].ref_cnt == tables, "reference count != tables holding it"
    assert kv.num_free_blocks == sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)
    # Only running sequences hold blocks: a table kept past a finish or a preemption has
    # consistent counts, so the check above misses it; this one fails the step it happens.
    assert set(kv.tables) == {s.request_id for s in sched.running}, "blocks held past a run"
    for req in batch.requests:
        s = sched.sequences[req.request_id]
        need = kv.blocks_needed(req.start_pos + len(req.token_ids))
        assert len(req.block_table) >= need, "scheduled tokens without KV room"
        assert req.start_pos == s.num_computed_tokens
