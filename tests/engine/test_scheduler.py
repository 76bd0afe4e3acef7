"""The scheduler alone: plain data in, plain data out, a fake runner for the tokens."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from engine import protocol
from engine.fair_queue import FairQueue
from tests.engine.scheduling import (
    check_invariants,
    fake_tokens,
    run_to_completion,
    scheduler,
    seq,
)


def test_requests_join_and_leave_the_batch_every_step():
    sched = scheduler(budget=64)
    short, long = seq(4, max_tokens=1), seq(4, max_tokens=5)
    sched.add(short)
    sched.add(long)
    batch = sched.schedule()
    assert {r.request_id for r in batch.requests} == {short.request_id, long.request_id}
    outs = sched.postprocess(batch, fake_tokens(batch))
    assert [o.request_id for o in outs if o.finished] == [short.request_id]
    late = seq(4)
    sched.add(late)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == [long.request_id, late.request_id]


def test_decodes_come_first_and_prefill_is_chunked_under_the_budget():
    sched = scheduler(budget=10)
    a = seq(4, max_tokens=8)
    sched.add(a)
    sched.postprocess(b := sched.schedule(), fake_tokens(b))  # a is decoding now
    big = seq(30)
    sched.add(big)
    batch = sched.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in batch.requests] == \
        [(a.request_id, 1), (big.request_id, 9)]
    assert not batch.requests[1].sample  # mid-prompt: nothing to sample yet
    sched.postprocess(batch, fake_tokens(batch))
    batch = sched.schedule()
    assert [(r.request_id, r.start_pos, len(r.token_ids)) for r in batch.requests] == \
        [(a.request_id, 5, 1), (big.request_id, 9, 9)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = scheduler(budget=10, chunked=False)
    a, b = seq(6), seq(6)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [len(r.token_ids) for r in batch.requests] == [6]
    assert all(r.sample for r in batch.requests)


def test_running_sequences_are_capped():
    sched = scheduler(max_num_seqs=3, budget=1000)
    for _ in range(5):
        sched.add(seq(4, max_tokens=10))
    batch = sched.schedule()
    assert len(batch.requests) == 3 and len(sched.waiting) == 2


def test_a_flooding_tenant_cannot_starve_another():
    sched = scheduler(max_num_seqs=2, budget=1000)
    flood = [seq(4, tenant="noisy", max_tokens=3) for _ in range(20)]
    for s in flood:
        sched.add(s)
    quiet = seq(4, tenant="quiet", max_tokens=3)
    sched.add(quiet)
    batch = sched.schedule()
    assert quiet.request_id in {r.request_id for r in batch.requests}


def test_tenants_take_turns_within_a_priority_class():
    queue = FairQueue()
    for tenant, n in (("a", 3), ("b", 2), ("c", 1)):
        for _ in range(n):
            queue.push(seq(tenant=tenant))
    order = [queue.pop().tenant_id for _ in range(6)]
    assert order == ["a", "b", "c", "a", "b", "a"]


def test_a_better_priority_class_goes_first():
    sched = scheduler(max_num_seqs=1, budget=1000)
    batch_job = seq(4, tenant="a", priority=5)
    interactive = seq(4, tenant="b", priority=0)
    sched.add(batch_job)
    sched.add(interactive)
    assert [r.request_id for r in sched.schedule().requests] == [interactive.request_id]


def test_running_out_of_blocks_preempts_the_latest_lowest_priority_sequence():
    # 6 blocks of 4 tokens; three sequences of 8 prompt tokens each take 2 blocks.
    sched = scheduler(num_blocks=6, block_size=4, budget=100)
    first, second, third = seq(8, max_tokens=8), seq(8, max_tokens=8), seq(8, max_tokens=8)
    for s in (first, second, third):
        sched.add(s)
    sched.postprocess(b := sched.schedule(), fake_tokens(b))
    assert sched.kv.num_free_blocks == 0
    batch = sched.schedule()  # every sequence now needs a third block
    check_invariants(sched, batch)
    assert sched.num_preemptions >= 1
    assert third.num_computed_tokens == 0 and third in list(sched.waiting)
    assert first.request_id in {r.request_id for r in batch.requests}


def test_a_preempted_sequence_resumes_by_recomputing_prompt_and_output():
    sched = scheduler(num_blocks=6, block_size=4, budget=100)
    seqs = [seq(8, max_tokens=8) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    outputs = run_to_completion(sched)
    for s in seqs:
        tokens = [t for out in outputs[s.request_id] for t in out.token_ids]
        assert tokens == [100 + i for i in range(8)]
        assert outputs[s.request_id][-1].finish_reason == protocol.FINISH_LENGTH
    assert sched.num_preemptions > 0 and sched.kv.num_free_blocks == 6


def test_identical_prompts_admitted_in_one_step_share_blocks():
    sched = scheduler(block_size=4, budget=100)
    prompt = list(range(10, 30))
    first, second = seq(prompt=prompt, max_tokens=1), seq(prompt=prompt, max_tokens=1)
    sched.add(first)
    sched.add(second)
    batch = sched.schedule()
    assert [(r.start_pos, len(r.token_ids)) for r in batch.requests] == [(0, 20), (16, 4)]
    assert batch.requests[0].block_table[:4] == batch.requests[1].block_table[:4]


def test_cached_prefix_is_skipped_and_reported():
    sched = scheduler(block_size=4, budget=100)
    prompt = list(range(10, 30))
    first = seq(prompt=prompt, max_tokens=1)
    sched.add(first)
    run_to_completion(sched)
    again = seq(prompt=prompt, max_tokens=1)
    sched.add(again)
    batch = sched.schedule()
    assert batch.requests[0].start_pos == 16 and len(batch.requests[0].token_ids) == 4
    (out,) = sched.postprocess(batch, fake_tokens(batch))
    assert out.usage.cached_tokens == 16 and out.usage.prompt_tokens == 20


def test_abort_frees_blocks_at_once_and_reports_usage_so_far():
    sched = scheduler(num_blocks=8, budget=100)
    s = seq(8, max_tokens=50)
    sched.add(s)
    for _ in range(3):
        sched.postprocess(b := sched.schedule(), fake_tokens(b))
    out = sched.abort(s.request_id, protocol.FINISH_CANCELLED)
    assert out.finished and out.finish_reason == protocol.FINISH_CANCELLED
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (8, 3)
    assert sched.kv.num_free_blocks == 8 and not sched.has_unfinished()
    assert sched.abort(s.request_id, protocol.FINISH_CANCELLED) is None


def test_a_waiting_request_past_its_deadline_ends_unbilled():
    sched = scheduler()
    s = seq(8)
    s.deadline = time.time() - 1
    sched.add(s)
    (out,) = sched.expire()
    assert out.finish_reason == protocol.FINISH_DEADLINE and out.usage.prompt_tokens == 0


def test_context_window_ends_a_generation():
    sched = scheduler(max_model_len=10, budget=100)
    s = seq(8, max_tokens=50)
    sched.add(s)
    outputs = run_to_completion(sched)
    assert outputs[s.request_id][-1].finish_reason == protocol.FINISH_LENGTH
    assert s.num_tokens == 10


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.sampled_from("abc"),
                                st.integers(0, 2)), min_size=1, max_size=25),
    num_blocks=st.integers(13, 40),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
    chunked=st.booleans(),
)
def test_any_workload_finishes_within_memory_and_budget(requests, num_blocks, budget,
                                                        max_num_seqs, chunked):
    budget = budget if chunked else 64  # without chunking the budget must hold a prompt
    sched = scheduler(num_blocks=num_blocks, block_size=4, budget=budget,
                      max_num_seqs=max_num_seqs, chunked=chunked)
    seqs = []
    for prompt_len, max_tokens, tenant, priority in requests:
        s = seq(prompt_len, max_tokens=max_tokens, tenant=tenant, priority=priority)
        seqs.append(s)
        sched.add(s)
    outputs = run_to_completion(sched)  # asserts the invariants every step
    for s in seqs:
        tokens = [t for out in outputs[s.request_id] for t in out.token_ids]
        assert tokens == [100 + i for i in range(s.params.max_tokens)]
    assert sched.kv.num_free_blocks == num_blocks


def test_batch_work_gives_its_seat_to_interactive_work_and_finishes_after():
    sched = scheduler(max_num_seqs=2)
    batch_lines = [seq(4, tenant="a", tier=protocol.TIER_BATCH, max_tokens=6) for _ in range(2)]
    for s in batch_lines:
        sched.add(s)
    sched.postprocess(first := sched.schedule(), fake_tokens(first))
    assert {s.request_id for s in sched.running} == {s.request_id for s in batch_lines}
    interactive = seq(4, tenant="b", priority=5, max_tokens=2)
    sched.add(interactive)
    batch = sched.schedule()
    assert interactive.request_id in [r.request_id for r in batch.requests]
    assert batch_lines[1] not in sched.running  # the latest gave its seat
    outputs = run_to_completion(sched)
    assert all(outputs[s.request_id][-1].finished for s in batch_lines)
    assert outputs[interactive.request_id][-1].finished


def test_batch_work_sits_out_the_steps_an_interactive_request_starts_in():
    sched = scheduler(max_num_seqs=8, budget=64)
    batch_lines = [seq(4, tenant="a", tier=protocol.TIER_BATCH, max_tokens=8)
                   for _ in range(3)]
    for s in batch_lines:
        sched.add(s)
    sched.postprocess(first := sched.schedule(), fake_tokens(first))
    interactive = seq(6, tenant="b", priority=5, max_tokens=3)
    sched.add(interactive)
    starting = sched.schedule()  # its prefill runs alone
    assert [r.request_id for r in starting.requests] == [interactive.request_id]
    sched.postprocess(starting, fake_tokens(starting))
    after = {r.request_id for r in sched.schedule().requests}  # past its first token
    assert after == {interactive.request_id, *(s.request_id for s in batch_lines)}


def test_an_interactive_request_short_of_kv_blocks_takes_them_from_batch_work():
    sched = scheduler(num_blocks=6, block_size=4, max_num_seqs=8, budget=64)
    hog = seq(16, tenant="a", tier=protocol.TIER_BATCH, max_tokens=8)
    sched.add(hog)
    sched.postprocess(first := sched.schedule(), fake_tokens(first))
    interactive = seq(12, tenant="b", priority=5, max_tokens=2)
    sched.add(interactive)
    outputs = run_to_completion(sched)
    assert outputs[interactive.request_id][-1].finished
    assert outputs[hog.request_id][-1].finished


def test_batch_work_takes_a_short_share_of_each_step():
    from engine.tiers import SPARE_STEP_TOKENS

    sched = scheduler(max_num_seqs=64, budget=512, num_blocks=512)
    for _ in range(20):
        sched.add(seq(8, tenant="a", tier=protocol.TIER_BATCH, max_tokens=4))
    interactive = seq(40, tenant="b", priority=5, max_tokens=4)
    steps = []
    for _ in range(60):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        steps.append(batch)
        sched.postprocess(batch, fake_tokens(batch))
        if len(steps) == 3:
            sched.add(interactive)
    for batch in steps:
        batch_tokens = sum(len(r.token_ids) for r in batch.requests
                           if r.request_id != interactive.request_id)
        assert batch_tokens <= SPARE_STEP_TOKENS
    assert not sched.has_unfinished()  # and all of it still finishes
