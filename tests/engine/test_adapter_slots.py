from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.fair_queue import FairQueue
from engine.lora.slots import AdapterSlots
from engine.sequence import Sequence
from tests.engine.scheduling import fake_tokens, run_to_completion, scheduler, seq


def adapter_seq(adapter: str | None, prompt_len: int = 4, **kw) -> Sequence:
    s = seq(prompt_len, **kw)
    s.adapter_hash = adapter
    return s


def test_slots_are_shared_by_users_and_reused_least_recently_used_first():
    slots = AdapterSlots(2)
    assert slots.acquire("a") == slots.acquire("a")
    b = slots.acquire("b")
    assert slots.acquire("c") is None  # both busy
    slots.release("b")
    slots.release("a")
    slots.release("a")  # idle order: b, then a
    c = slots.acquire("c")
    assert c == b and slots.slot_of == {"a": 0, "c": b}


def test_pinned_adapters_never_leave():
    slots = AdapterSlots(2, pinned=("p",))
    slots.acquire("p")
    slots.release("p")
    slots.acquire("x")
    slots.release("x")
    slots.acquire("y")  # evicts x, never p
    assert set(slots.slot_of) == {"p", "y"}
    with pytest.raises(ValueError):
        AdapterSlots(1, pinned=("p", "q"))


def test_candidates_interleave_tenants_round_by_round():
    queue = FairQueue()
    a1, a2, b1, c1 = seq(tenant="a"), seq(tenant="a"), seq(tenant="b"), seq(tenant="c")
    for s in (a1, a2, b1, c1):
        queue.push(s)
    assert list(queue.candidates()) == [a1, b1, c1, a2]
    queue.take(b1)
    assert list(queue.candidates()) == [a1, c1, a2]
    assert queue.pop() is a1 and queue.pop() is c1


def test_the_scheduler_passes_over_a_request_whose_adapter_has_no_slot():
    sched = scheduler(budget=100, max_num_seqs=8)
    sched.slots = AdapterSlots(1)
    first, blocked, base = seq(4, max_tokens=4), seq(4, max_tokens=4), seq(4, max_tokens=4)
    first.adapter_hash, blocked.adapter_hash = "x" * 64, "y" * 64
    for s in (first, blocked, base):
        sched.add(s)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == [first.request_id, base.request_id]
    assert [(r.adapter_slot, r.adapter_hash) for r in batch.requests] == [(0, "x" * 64),
                                                                            (-1, None)]
    assert blocked in list(sched.waiting)


def test_a_request_waiting_for_a_slot_gets_one_while_a_busy_adapter_keeps_arriving():
    sched = scheduler(num_blocks=256, budget=100, max_num_seqs=8)
    sched.slots = AdapterSlots(1)
    busy, quiet = "a" * 64, "b" * 64
    sched.add(adapter_seq(busy, tenant="t1"))
    sched.postprocess(batch := sched.schedule(), fake_tokens(batch))
    blocked = adapter_seq(quiet, tenant="t2")
    sched.add(blocked)
    finished = set()
    for _ in range(30):
        sched.add(adapter_seq(busy, tenant="t1"))  # a new request for the busy adapter each step
        batch = sched.schedule()
        finished |= {o.request_id for o in sched.postprocess(batch, fake_tokens(batch))
                     if o.finished}
    assert blocked.request_id in finished


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8), st.sampled_from("abc"),
                                st.sampled_from([None, "x", "y", "z"])), min_size=1, max_size=20),
    num_slots=st.integers(1, 3),
    num_blocks=st.integers(10, 40),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
)
def test_any_workload_with_adapters_finishes_within_its_slots(requests, num_slots, num_blocks,
                                                              budget, max_num_seqs):
    sched = scheduler(num_blocks=num_blocks, block_size=4, budget=budget,
                      max_num_seqs=max_num_seqs)
    sched.slots = AdapterSlots(num_slots)
    seqs = []
    for prompt_len, max_tokens, tenant, adapter in requests:
        s = adapter_seq(adapter and adapter * 64, prompt_len, max_tokens=max_tokens,
                        tenant=tenant)
        seqs.append(s)
        sched.add(s)
    outputs = run_to_completion(sched)  # asserts the invariants every step
    for s in seqs:
        assert outputs[s.request_id][-1].finished
    assert sched.slots.users == {}
