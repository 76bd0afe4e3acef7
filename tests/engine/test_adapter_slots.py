from __future__ import annotations

import pytest

from engine.fair_queue import FairQueue
from engine.lora.slots import AdapterSlots
from tests.engine.scheduling import scheduler, seq


def test_slots_are_shared_by_users_and_reused_least_recently_used_first():
    slots = AdapterSlots(2)
    assert slots.acquire("a") == slots.acquire("a")
    b = slots.acquire("b")
    assert slots.acquire("c") is None  # both busy
    slots.release("b")
    slots.release("a")
    slots.release("a")  # idle order: b, then a
    c = slots.acquire("c")
    assert c == b and "b" not in slots.slot_of and "a" in slots.slot_of
    assert [adapter for _, adapter in slots.take_loads()] == ["a", "b", "c"]
    assert slots.take_loads() == []


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


def test_an_empty_step_keeps_its_slot_loads_for_the_next_batch():
    sched = scheduler()
    sched.slots = AdapterSlots(2, pinned=("p" * 64,))
    assert sched.schedule().adapter_loads == []
    sched.add(seq(4))
    assert sched.schedule().adapter_loads == [(0, "p" * 64)]


def test_candidates_interleave_tenants_round_by_round():
    queue = FairQueue()
    a1, a2, b1, c1 = seq(tenant="a"), seq(tenant="a"), seq(tenant="b"), seq(tenant="c")
    for s in (a1, a2, b1, c1):
        queue.push(s)
    assert queue.candidates() == [a1, b1, c1, a2]
    queue.take(b1)
    assert queue.candidates() == [a1, c1, a2]
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
    assert batch.adapter_loads == [(0, "x" * 64)]
    assert blocked in list(sched.waiting)
