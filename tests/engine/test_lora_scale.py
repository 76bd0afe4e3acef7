"""Many adapters over one base model: a thousand in the store, a few slots and a small host
memory, batches mixing many of them, and tenants sharing the tiers fairly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from lora_testing import peft_greedy, random_adapter
from test_llm_engine import drain, request, tokens

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.cache import AdapterCache
from engine.lora.shares import fair_victim
from engine.lora.slots import AdapterSlots
from engine.lora.store import AdapterStore
from engine.models.model_config import ModelConfig

STORED = 1000
MAX_NEW = 8
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def thousand(tiny_model_dir, tmp_path_factory) -> tuple[Path, list[Path], list[str]]:
    """A store of 1,000 distinct rank-8 adapters: (its root, their PEFT folders, hashes)."""
    root = tmp_path_factory.mktemp("thousand")
    store = AdapterStore(root / "store")
    folders = [random_adapter(tiny_model_dir, root / f"a{i}", seed=i, r=8) for i in range(STORED)]
    return store.root, folders, [store.put(folder) for folder in folders]


def engine(tiny_model_dir, store_root, **options) -> LLMEngine:
    options = {"max_loras": 4, "max_lora_rank": 8, "max_cpu_loras": 6, **options}
    return LLMEngine(EngineConfig(model_dir=tiny_model_dir, adapter_store=store_root, **options))


def run(eng: LLMEngine, jobs: list[tuple[str, str, str]]) -> dict[str, list[int]]:
    """(request id, tenant, adapter hash) all at once; each request's tokens."""
    for rid, tenant, adapter_hash in jobs:
        eng.add_request(request(rid, PROMPT, tenant=tenant, adapter=rid,
                                adapter_hash=adapter_hash, max_tokens=MAX_NEW))
    outputs = drain(eng)
    for rid, outs in outputs.items():
        assert not outs[-1].error, (rid, outs[-1].error)
    return {rid: tokens(outs) for rid, outs in outputs.items()}


def test_a_mixed_batch_of_adapters_drawn_from_a_thousand_equals_peft_for_each(
        tiny_model_dir, thousand):
    store_root, folders, hashes = thousand
    picks = random.Random(7).sample(range(STORED), 12)
    # 12 distinct adapters through 4 slots and 6 adapters of host memory: slots turn over
    # and host memory evicts while the batch runs.
    eng = engine(tiny_model_dir, store_root)
    got = run(eng, [(f"a{i}", f"tenant-{n % 3}", hashes[i]) for n, i in enumerate(picks)])
    assert eng.adapters.slots.evictions > 0
    outputs = {i: peft_greedy(tiny_model_dir, folders[i], [PROMPT], MAX_NEW)[0] for i in picks}
    assert len({tuple(o) for o in outputs.values()}) > 1  # the adapters differ
    for i in picks:
        assert got[f"a{i}"] == outputs[i], i


def test_an_adapter_evicted_to_the_store_and_loaded_again_gives_the_same_output(
        tiny_model_dir, thousand):
    store_root, folders, hashes = thousand
    eng = engine(tiny_model_dir, store_root, max_loras=2, max_cpu_loras=2)
    first = run(eng, [("first", "t", hashes[500])])["first"]
    for i in range(6):  # the same tenant's other adapters push it out of both tiers
        run(eng, [(f"other-{i}", "t", hashes[600 + i])])
    assert hashes[500] not in eng.adapters and hashes[500] not in eng.adapters.slots.slot_of
    loads = eng.adapters.host_misses
    again = run(eng, [("again", "t", hashes[500])])["again"]
    assert eng.adapters.host_misses == loads + 1  # read from the store again
    assert again == first == peft_greedy(tiny_model_dir, folders[500], [PROMPT], MAX_NEW)[0]


def test_a_tenant_flooding_distinct_adapters_leaves_another_tenants_adapter_resident(
        tiny_model_dir, thousand):
    store_root, _, hashes = thousand
    eng = engine(tiny_model_dir, store_root, max_loras=2, max_cpu_loras=2)
    quiet = hashes[10]
    run(eng, [("quiet", "quiet-tenant", quiet)])
    for i in range(8):  # one after another: each load finds the quiet adapter idle
        run(eng, [(f"flood-{i}", "flooder", hashes[100 + i])])
    assert quiet in eng.adapters  # host memory
    assert quiet in eng.adapters.slots.slot_of  # a device slot
    hits = eng.adapters.slots.hits
    run(eng, [("quiet-again", "quiet-tenant", quiet)])
    assert eng.adapters.slots.hits == hits + 1  # no copy, no load


def test_a_corrupt_adapter_in_the_store_fails_only_its_request(tiny_model_dir, thousand,
                                                               tmp_path):
    store_root, folders, hashes = thousand
    store = AdapterStore(store_root)
    broken = tmp_path / "broken"
    random_adapter(tiny_model_dir, broken, seed=5000, r=8)
    bad_hash = store.put(broken)
    weights = store.path(bad_hash) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated after it was stored
    eng = engine(tiny_model_dir, store_root)
    eng.add_request(request("bad", PROMPT, adapter="broken", adapter_hash=bad_hash))
    for i in (1, 2, 3):
        eng.add_request(request(f"good-{i}", PROMPT, adapter=f"a{i}", adapter_hash=hashes[i],
                                max_tokens=MAX_NEW))
    outputs = drain(eng)
    assert outputs["bad"][-1].error and not tokens(outputs["bad"])
    for i in (1, 2, 3):
        assert tokens(outputs[f"good-{i}"]) == \
            peft_greedy(tiny_model_dir, folders[i], [PROMPT], MAX_NEW)[0]
    # The engine goes on serving.
    assert run(eng, [("after", "t", hashes[4])])["after"]


# -- the fair choice, unit by unit -----------------------------------------------------------

def test_the_victim_is_the_incoming_tenants_own_adapter_when_shares_are_even():
    owners = {"a1": ("a", 1.0), "b1": ("b", 1.0), "b2": ("b", 1.0)}
    # a's one adapter is older, but b brings a third in: b is over its share.
    assert fair_victim(["a1", "b1"], ["a1", "b1"], owners, ("b", 1.0)) == "b1"
    assert fair_victim(["a1", "b1", "b2"], ["a1", "b1", "b2"], owners) == "b1"
    # A weight of 3 gives b three times a's share: now a is further over it.
    heavy = {k: (t, 3.0 if t == "b" else 1.0) for k, (t, _) in owners.items()}
    assert fair_victim(["a1", "b1", "b2"], ["a1", "b1", "b2"], heavy) == "a1"
    assert fair_victim([], ["a1"], owners) is None


def test_slots_evict_the_flooding_tenants_idle_adapter_not_the_others():
    owners = {"quiet": ("q", 1.0), **{f"f{i}": ("f", 1.0) for i in range(5)}}
    slots = AdapterSlots(2, owners=owners)
    quiet = slots.acquire("quiet")
    slots.release("quiet")  # idle, least recently used from here on
    for i in range(5):
        slots.acquire(f"f{i}")
        slots.release(f"f{i}")
    assert slots.slot_of["quiet"] == quiet and slots.evictions == 4


def test_host_memory_evicts_the_flooding_tenants_adapters(tiny_model_dir, thousand):
    store_root, _, hashes = thousand
    owners = {hashes[0]: ("quiet", 1.0)}
    cache = AdapterCache(AdapterStore(store_root), ModelConfig.from_dir(tiny_model_dir),
                         max_rank=8, dtype=torch.float32, capacity=3, owners=owners)
    try:
        for i in range(8):
            owners[hashes[i]] = owners.get(hashes[i], ("flooder", 1.0))
            cache.retain(hashes[i])
            cache.wait(timeout=10)
            cache.poll()
            cache.release(hashes[i])
        assert hashes[0] in cache and len(cache.loaded()) == 3
    finally:
        cache.close()


# -- a plan's limit on how many adapters a tenant holds ----------------------------------------


def test_a_tenant_capped_by_its_plan_never_holds_more_slots_and_its_outputs_equal_peft(
        tiny_model_dir, thousand):
    store_root, folders, hashes = thousand
    eng = engine(tiny_model_dir, store_root, max_loras=4, max_cpu_loras=8)
    capped = [300, 301, 302, 303, 304]
    for i in capped:  # all at once: five adapters, two slots' worth for this tenant
        req = request(f"c{i}", PROMPT, tenant="capped", adapter=f"a{i}",
                      adapter_hash=hashes[i], max_tokens=MAX_NEW)
        req.max_resident_adapters = 2
        eng.add_request(req)
    for i in (400, 401):
        eng.add_request(request(f"o{i}", PROMPT, tenant="other", adapter=f"a{i}",
                                adapter_hash=hashes[i], max_tokens=MAX_NEW))
    mine = {hashes[i] for i in capped}
    outputs: dict[str, list] = {}
    most = 0
    for _ in range(5_000):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            outputs.setdefault(out.request_id, []).append(out)
        most = max(most, len(mine & set(eng.adapters.slots.slot_of)))
    assert not eng.has_unfinished()
    assert most == 2  # it used its two slots, never a third
    for rid, i in [*((f"c{i}", i) for i in capped), ("o400", 400), ("o401", 401)]:
        assert not outputs[rid][-1].error
        assert tokens(outputs[rid]) == peft_greedy(tiny_model_dir, folders[i], [PROMPT],
                                                   MAX_NEW)[0], rid
    # Host memory had room for all seven; the capped tenant keeps its two most recent.
    assert len(mine & set(eng.adapters.resident())) == 2
    assert {hashes[400], hashes[401]} <= set(eng.adapters.resident())


def test_host_memory_lets_a_tenant_over_its_limit_keep_only_what_its_requests_use(
        tiny_model_dir, thousand):
    store_root, _, hashes = thousand
    owners = {h: ("capped", 1.0) for h in hashes[700:704]}
    limits = {"capped": 2}
    cache = AdapterCache(AdapterStore(store_root), ModelConfig.from_dir(tiny_model_dir),
                         max_rank=8, dtype=torch.float32, capacity=10, owners=owners,
                         limits=limits)
    try:
        for h in hashes[700:703]:  # three in use at once: the limit does not refuse them
            cache.retain(h)
        while len(cache.loaded()) < 3:
            cache.wait(timeout=10)
            cache.poll()
        cache.release(hashes[700])  # idle, and the tenant is over its limit: it goes
        assert set(cache.loaded()) == set(hashes[701:703])
        cache.retain(hashes[703])
        while hashes[703] not in cache:
            cache.wait(timeout=10)
            cache.poll()
        cache.release(hashes[701])
        cache.release(hashes[702])  # idle: the least recently used of the two goes
        assert set(cache.loaded()) == {hashes[702], hashes[703]}
    finally:
        cache.close()


def test_a_waiting_requests_adapter_is_copied_into_a_slot_beside_the_step_before_it_starts(
        tiny_model_dir, thousand):
    store_root, folders, hashes = thousand
    eng = engine(tiny_model_dir, store_root, max_loras=2, max_num_seqs=1)
    for i in (11, 10, 12):  # all three in host memory; 10 and 12 in the two slots
        run(eng, [(f"warm-{i}", "t", hashes[i])])
    assert set(eng.adapters.slots.slot_of) == {hashes[10], hashes[12]}
    copied_before_a_step = []
    copy = eng.runner.copy_adapter

    def recorded(slot, adapter):
        copied_before_a_step.append(adapter.adapter_hash)
        copy(slot, adapter)

    eng.runner.copy_adapter = recorded
    eng.add_request(request("first", PROMPT, tenant="t1", adapter="first",
                            adapter_hash=hashes[10], max_tokens=MAX_NEW))
    outputs = {"first": eng.step()}
    hits, staged = eng.adapters.slots.hits, eng.adapters.slots.staged
    # The second waits for the one seat; the first's next step copies its adapter into the
    # idle slot beside its forward pass.
    eng.add_request(request("second", PROMPT, tenant="t2", adapter="second",
                            adapter_hash=hashes[11], max_tokens=MAX_NEW))
    for rid, outs in drain(eng).items():
        outputs.setdefault(rid, []).extend(outs)
    assert eng.adapters.slots.staged == staged + 1
    assert eng.adapters.slots.hits == hits + 1  # its start found it in place
    assert copied_before_a_step == []  # no step waited for a copy
    assert eng.adapters.slots.slot_of[hashes[11]] is not None
    for rid, i in (("first", 10), ("second", 11)):
        assert tokens(outputs[rid]) == peft_greedy(tiny_model_dir, folders[i], [PROMPT],
                                                   MAX_NEW)[0], rid
    assert eng.adapters.stats()["adapter_slot_staged"] == eng.adapters.slots.staged


def test_a_staged_slot_is_taken_as_acquire_would_take_it_and_kept_for_its_request():
    owners = {"q": ("quiet", 1.0), "f0": ("flood", 1.0), "f1": ("flood", 1.0),
              "f2": ("flood", 1.0), "f3": ("flood", 1.0)}
    slots = AdapterSlots(3, owners=owners, limits={"flood": 2})
    slots.acquire("q")
    assert slots.stage("f0", "flood") is not None and slots.stage("f0", "flood") is None
    assert slots.users == {"q": 1}  # staged: idle, in no request's use
    assert slots.stage("f1", "flood") is not None
    # The flooding tenant is at its cap of two, both kept for its waiting requests: staging
    # a third takes neither; a request starting takes its own oldest as before.
    assert slots.stage("f2", "flood") is None
    slots.acquire("f2", "flood")
    assert "f0" not in slots.slot_of and slots.slot_of.keys() == {"q", "f1", "f2"}
    slots.release("f2")
    slots.kept_for_waiting = {"f1"}  # the next waiting requests want f1 only
    assert slots.stage("f3", "flood") == slots.slot_of["f3"] and "f2" not in slots.slot_of
    slots.acquire("f1", "flood")
    slots.acquire("f3", "flood")
    assert slots.stage("f0", "flood") is None  # its own are busy, and the quiet one's too
    assert slots.hits == 2 and slots.misses == 2 and slots.staged == 3
