from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.fair_queue import FairQueue
from engine.lora.slots import AdapterSlots, SlotClaims
from engine.sequence import Sequence
from tests.engine.scheduling import (
    check_invariants,
    fake_tokens,
    run_to_completion,
    scheduler,
    seq,
)


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


# -- a plan's limit on a tenant's adapters in slots ----------------------------------------


def test_a_tenant_at_its_limit_takes_a_slot_only_in_place_of_its_own_idle_adapter():
    owners = {"c1": ("capped", 1.0), "c2": ("capped", 1.0), "c3": ("capped", 1.0),
              "o1": ("other", 1.0)}
    slots = AdapterSlots(4, owners=owners, limits={"capped": 2})
    slots.acquire("o1", "other")
    slots.release("o1")  # idle, the oldest: plain LRU would give its slot away first
    first = slots.acquire("c1", "capped")
    slots.acquire("c2", "capped")
    # Two slots are free, but "capped" holds its two, both busy: it waits for its own.
    assert not slots.can_acquire("c3", "capped") and slots.waits_for_own("c3", "capped")
    assert slots.acquire("c3", "capped") is None
    assert slots.can_acquire("o2", "other") and not slots.waits_for_own("o2", "other")
    slots.release("c1")
    assert slots.acquire("c3", "capped") == first  # c1's slot, not a free one, not o1's
    assert set(slots.slot_of) == {"o1", "c2", "c3"} and slots.evictions == 1


def test_a_tenant_with_no_limit_uses_free_slots_as_before():
    slots = AdapterSlots(3, owners={a: ("t", 1.0) for a in "abc"}, limits={"u": 1})
    assert [slots.acquire(a, "t") for a in "abc"] == [0, 1, 2]


def test_pinned_adapters_do_not_count_against_a_tenants_limit():
    slots = AdapterSlots(3, pinned=("p",), owners={"p": ("t", 1.0), "a": ("t", 1.0)},
                         limits={"t": 1})
    assert slots.acquire("a", "t") is not None


def test_a_request_waiting_for_its_own_tenants_slot_holds_back_that_tenant_only():
    sched = scheduler(num_blocks=256, budget=100, max_num_seqs=8)
    owners = {"a" * 64: ("capped", 1.0), "b" * 64: ("capped", 1.0), "c" * 64: ("other", 1.0)}
    sched.slots = AdapterSlots(4, owners=owners, limits={"capped": 1})
    first = adapter_seq("a" * 64, tenant="capped", max_tokens=3)
    second = adapter_seq("b" * 64, tenant="capped", max_tokens=3)
    later = adapter_seq("a" * 64, tenant="capped", max_tokens=3)  # its adapter is in a slot
    other = adapter_seq("c" * 64, tenant="other", max_tokens=3)
    for s in (first, second, later, other):
        sched.add(s)
    batch = sched.schedule()
    # The other tenant starts though it queued behind the capped tenant's waiting request;
    # the capped tenant's later request waits behind its own, so its slot drains.
    assert {r.request_id for r in batch.requests} == {first.request_id, other.request_id}
    started = {}
    for step in range(20):
        if step:
            batch = sched.schedule()
        for r in batch.requests:
            started.setdefault(r.request_id, step)
        capped = [a for a in sched.slots.slot_of if owners[a][0] == "capped"]
        assert len(capped) <= 1, capped
        sched.postprocess(batch, fake_tokens(batch))
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert started[first.request_id] < started[second.request_id] < started[later.request_id]


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6), st.sampled_from("abc"),
                                st.sampled_from("uvwxyz")), min_size=1, max_size=16),
    limits=st.dictionaries(st.sampled_from("abc"), st.integers(1, 3)),
    num_slots=st.integers(1, 4),
    budget=st.integers(4, 48),
)
def test_any_workload_finishes_and_no_tenant_ever_holds_more_slots_than_its_limit(
        requests, limits, num_slots, budget):
    sched = scheduler(num_blocks=40, block_size=4, budget=budget, max_num_seqs=4)
    owners = {}
    sched.slots = AdapterSlots(num_slots, owners=owners, limits=limits)
    seqs = []
    for prompt_len, max_tokens, tenant, adapter in requests:
        owners[tenant + adapter * 63] = (tenant, 1.0)  # each tenant's own adapters
        seqs.append(adapter_seq(tenant + adapter * 63, prompt_len, max_tokens=max_tokens,
                                tenant=tenant))
        sched.add(seqs[-1])
    for _ in range(5_000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        check_invariants(sched, batch)
        held = Counter(owners[a][0] for a in sched.slots.slot_of)
        assert all(held[t] <= limit for t, limit in limits.items()), (held, limits)
        sched.postprocess(batch, fake_tokens(batch))
    assert not sched.has_unfinished() and sched.slots.users == {}


def test_claims_without_limits_stop_at_the_first_request_the_full_table_turns_away():
    slots = AdapterSlots(1)
    slots.acquire("x")
    claims = SlotClaims(slots)
    assert not claims.admit("y", "t1")
    assert not claims.admit("x", "t2")  # in a slot, but the one waiting goes first
