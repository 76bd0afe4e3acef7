"""The prefix cache's host tier: blocks the pool evicts are kept in host memory and loaded
back instead of recomputed, with the same output, never across tenants, fairly between
them, and composed with preemption and speculation."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.host_kv import LOAD, SAVE, HostKVTier
from engine.llm_engine import LLMEngine
from engine.metrics import render_prometheus
from tests.engine.test_llm_engine import drain, request, tokens

MAX_NEW = 12


def _key(i: int) -> bytes:
    return i.to_bytes(32, "little")


# -- the tier on its own ----------------------------------------------------------------------

def test_saved_blocks_are_found_in_order_and_loaded_from_their_slot():
    tier = HostKVTier(4)
    for block, i in ((7, 1), (8, 2), (9, 3)):
        tier.save(block, _key(i), "a")
    assert tier.lookup([_key(1), _key(2), _key(5), _key(3)]) == 2  # a chain stops at a miss
    tier.load(_key(2), 3)
    tier.save(8, _key(2), "a")  # evicted again: it is here already, nothing to copy
    moves = tier.take_moves()
    assert [m[0] for m in moves] == [SAVE, SAVE, SAVE, LOAD]
    assert moves[3] == (LOAD, moves[1][2], 3) and tier.take_moves() == []
    assert tier.stats.saves == 3 and tier.stats.loads == 1


def test_a_freed_block_is_copied_ahead_and_its_eviction_then_costs_no_copy():
    tier = HostKVTier(4)
    tier.keep(7, _key(1), "a")  # the pool freed it: copied beside the next step
    assert tier.holds(_key(1)) and tier.take_moves() == []
    ((kind, block, slot),) = tier.take_ahead()
    assert (kind, block) == (SAVE, 7) and tier.take_ahead() == []
    tier.keep(7, _key(1), "a")  # freed again (a later request hit it): here already
    tier.save(7, _key(1), "a")  # handed out again: nothing to copy before the step
    assert tier.take_moves() == tier.take_ahead() == [] and tier.stats.saves == 1
    tier.load(_key(1), 2)
    assert tier.take_moves() == [(LOAD, slot, 2)]


def test_a_block_handed_out_before_its_copy_ahead_is_copied_before_the_step_writes_it():
    tier = HostKVTier(4)
    tier.keep(7, _key(1), "a")
    tier.keep(8, _key(2), "a")
    tier.save(7, _key(1), "a")  # freed and handed out again in one step
    ((_, _, slot),) = [m for m in tier.take_moves()]
    assert tier.take_moves() == [] and [m[1] for m in tier.take_ahead()] == [8]
    tier.load(_key(1), 3)  # and its copy is what a later restore reads
    assert tier.take_moves() == [(LOAD, slot, 3)] and tier.stats.saves == 2


def test_a_copy_ahead_whose_slot_is_given_up_before_the_step_is_not_made():
    tier = HostKVTier(1)
    tier.keep(7, _key(1), "a")
    tier.keep(8, _key(2), "a")  # the only slot goes to the newer block
    assert tier.take_ahead() == [(SAVE, 8, 0)] and not tier.holds(_key(1))
    tier.save(7, _key(1), "a")  # handed out later: copied then, before the step
    assert tier.take_moves() == [(SAVE, 7, 0)] and tier.take_ahead() == []


def test_a_restore_beside_the_step_keeps_its_slot_until_the_step_takes_it():
    tier = HostKVTier(1)
    tier.save(0, _key(1), "a")
    tier.take_moves()
    tier.restore(_key(1), 5)
    tier.save(1, _key(2), "a")  # the only slot is about to be read: this block is not kept
    assert not tier.holds(_key(2)) and tier.take_moves() == []
    assert tier.take_ahead() == [(LOAD, 0, 5)] and tier.stats.loads == 1
    tier.save(1, _key(2), "a")  # the copy is the step's now: the slot may go
    assert tier.holds(_key(2)) and tier.take_moves() == [(SAVE, 1, 0)]


def test_a_flooding_tenant_evicts_its_own_blocks_not_anothers_share():
    tier = HostKVTier(10)
    for i in range(4):
        tier.save(i, _key(1000 + i), "quiet")
    for i in range(500):  # a tenant saving blocks by the hundred
        tier.save(100 + i, _key(i), "flood")
    assert tier.used_by("quiet") == 4 and tier.used_by("flood") == 6
    assert tier.lookup([_key(1000 + i) for i in range(4)]) == 4
    # A weight of 3 to 1 gives the heavier tenant three quarters of the tier.
    tier.reset()
    for i in range(200):
        tier.save(i, _key(i), "light", 1.0)
        tier.save(1000 + i, _key(1000 + i), "heavy", 3.0)
    assert (tier.used_by("heavy"), tier.used_by("light")) in ((7, 3), (8, 2))


def test_a_block_about_to_be_loaded_is_not_given_up_for_a_save():
    tier = HostKVTier(2)
    tier.save(0, _key(1), "a")
    tier.save(1, _key(2), "a")
    tier.pin([_key(1), _key(2)])
    tier.save(2, _key(3), "a")  # full and everything pinned: this one is not kept
    assert not tier.holds(_key(3)) and tier.num_used == 2
    tier.pin([_key(1), _key(2)], -1)
    tier.save(2, _key(3), "a")
    assert tier.holds(_key(3)) and not tier.holds(_key(1))  # the least recently used went


def test_a_retained_block_is_given_up_last_until_it_goes_unused_that_long():
    now = [0.0]
    tier = HostKVTier(6, clock=lambda: now[0])
    for i in range(2):
        tier.save(i, _key(100 + i), "keeper", retention_s=3600)  # the oldest here
    for i in range(40):  # another tenant's blocks, and the keeper's own unretained ones
        tier.save(10 + i, _key(i), "busy")
    assert tier.holds(_key(100)) and tier.holds(_key(101))
    tier.save(60, _key(200), "keeper")
    tier.save(61, _key(201), "keeper")  # its share is 3: its unretained block goes first
    assert tier.holds(_key(100)) and tier.holds(_key(101)) and tier.used_by("keeper") == 3
    tier.save(62, _key(202), "keeper")  # again its newer ordinary block goes
    assert tier.holds(_key(100)) and not tier.holds(_key(201))
    now[0] = 3601.0  # an hour unused: ordinary blocks again, least recently used first
    tier.save(63, _key(203), "keeper")
    assert not tier.holds(_key(100)) and tier.holds(_key(101)) and tier.holds(_key(202))


def test_retention_past_a_tenants_share_protects_nothing():
    tier = HostKVTier(4)
    for i in range(30):
        tier.save(i, _key(i), "hoarder", retention_s=86400)
        tier.save(100 + i, _key(100 + i), "other")
    assert tier.used_by("hoarder") == tier.used_by("other") == 2


# -- in the engine --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def conversations() -> list[list[int]]:
    """Six tenants' long prompts (a 96-token prefix each, then a turn of their own)."""
    rng = random.Random(7)
    return [[rng.randrange(10, 1400) for _ in range(96 + 5 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, conversations: list[list[int]]) -> list[list[int]]:
    from engine.reference import generate_reference

    return generate_reference(tiny_model_dir, conversations, MAX_NEW)


def _engine(model_dir: Path, *, host_mib: float = 8, **options) -> LLMEngine:
    # A pool that holds about two of the six prompts: the others' blocks are evicted.
    options = {"num_kv_blocks": 16, "block_size": 16, "max_num_batched_tokens": 128,
               **options}
    return LLMEngine(EngineConfig(model_dir=model_dir, kv_host_bytes=int(host_mib * 2**20),
                                  **options))


def _round(engine: LLMEngine, conversations: list[list[int]], tag: str,
           tenant=lambda i: f"t{i}") -> tuple[list[list[int]], list[int]]:
    """Each prompt in turn (one at a time: each evicts what the others cached)."""
    outs, cached = [], []
    for i, prompt in enumerate(conversations):
        engine.add_request(request(f"{tag}{i}", prompt, tenant=tenant(i), salt=tenant(i),
                                   max_tokens=MAX_NEW, ignore_eos=True))
        done = drain(engine)[f"{tag}{i}"]
        outs.append(tokens(done))
        cached.append(done[-1].usage.cached_tokens)
    return outs, cached


def test_a_restored_prefix_gives_the_same_greedy_output_as_computing_it(
        tiny_model_dir, conversations, expected):
    engine = _engine(tiny_model_dir)
    first, cached = _round(engine, conversations, "a")
    assert first == expected and cached == [0] * 6
    again, cached = _round(engine, conversations, "b")
    assert again == expected
    # Every prefix came back (the pool held too few of them): 6 full blocks each.
    assert cached == [96] * 6
    snap = engine.snapshot()
    assert snap["external_prefix_cache_hits"] >= 4 * 96 and snap["kv_host_loads"] >= 4 * 6
    assert snap["kv_host_saves"] > 0 and snap["kv_host_blocks_used"] > 0
    text = render_prometheus(snap, model_name="tiny", engine="e1")
    loaded = snap["external_prefix_cache_hits"]
    assert f'vllm:external_prefix_cache_hits_total{{engine="e1",model_name="tiny"}} ' \
        f'{float(loaded)}' in text
    assert "# TYPE atrium_engine_kv_host_blocks_used gauge" in text
    assert 'atrium_engine_step_phase_seconds_total{engine="e1",model_name="tiny",' \
        'phase="kv_host"}' in text

    # Without the host tier, the same pool recomputes what it evicted.
    plain = _engine(tiny_model_dir, host_mib=0)
    _round(plain, conversations, "a")
    again, cached = _round(plain, conversations, "b")
    assert again == expected and sum(cached) < 96 * 6
    assert "external_prefix_cache_hits" not in plain.snapshot()


def test_a_restored_block_from_another_tenant_is_never_used(tiny_model_dir, conversations,
                                                            expected):
    engine = _engine(tiny_model_dir)
    _round(engine, conversations, "a", tenant=lambda i: "owner")
    loads = engine.snapshot()["kv_host_loads"]
    # The same prompts under other tenants: nothing of the owner's is found in either tier.
    outs, cached = _round(engine, conversations, "b", tenant=lambda i: f"other{i}")
    assert outs == expected and cached == [0] * 6
    assert engine.snapshot()["kv_host_loads"] == loads


def test_freed_blocks_are_copied_beside_the_steps_and_restore_the_same_output(
        tiny_model_dir, conversations, expected, monkeypatch):
    # A pool with room for about four prompts: what a request frees sits in the free queue
    # for a step or more before another request's blocks take its place.
    engine = _engine(tiny_model_dir, num_kv_blocks=32)
    before, beside = [], []
    for name, seen in (("take_host_moves", before), ("take_host_ahead", beside)):
        take = getattr(engine.kv, name)
        monkeypatch.setattr(engine.kv, name, lambda take=take, seen=seen: seen.extend(
            moves := take()) or moves)
    _round(engine, conversations, "a")
    outs, cached = _round(engine, conversations, "b")
    assert outs == expected and min(cached) >= 96
    assert engine.snapshot()["kv_host_loads"] > 0
    saves = [m for m in before if m[0] == SAVE]
    assert len(beside) > 0 and len(saves) <= len(beside) // 4, (len(saves), len(beside))
    text = render_prometheus(engine.snapshot(), model_name="tiny", engine="e1")
    assert 'atrium_engine_step_phase_seconds_total{engine="e1",model_name="tiny",' \
        'phase="kv_host_wait"}' in text


def test_copies_decided_in_a_step_that_runs_no_request_are_still_made(
        tiny_model_dir, conversations, expected):
    engine = _engine(tiny_model_dir)
    _round(engine, conversations, "a")
    # The last request's blocks were freed as it ended: their copies ahead are decided,
    # and this step schedules nothing.
    assert engine.step() == [] and engine.kv.host.take_ahead() == []
    # Each tenant's prompt again: by the last one's turn, the pool has evicted its prefix.
    outs, cached = _round(engine, conversations, "b")
    assert outs == expected and min(cached) >= 96


def test_a_prefix_restored_beside_a_step_holds_back_only_its_own_request(
        tiny_model_dir, conversations, expected, monkeypatch):
    engine = _engine(tiny_model_dir)
    _round(engine, conversations, "a")  # the pool keeps the last prompts; t0's went to host
    batches = []
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule",
                        lambda: batches.append(batch := schedule()) or batch)
    engine.add_request(request("busy", conversations[5], tenant="t5", salt="t5",
                               max_tokens=MAX_NEW, ignore_eos=True))
    outputs: dict[str, list] = {}
    while "busy" not in outputs:  # running: its prompt was found in the pool
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    loads = engine.snapshot()["kv_host_loads"]
    engine.add_request(request("back", conversations[0], tenant="t0", salt="t0",
                               max_tokens=MAX_NEW, ignore_eos=True))
    for out in engine.step():
        outputs.setdefault(out.request_id, []).append(out)
    # That step ran the busy request alone, its prefix's copies beside it, none before it.
    restoring = batches[-1]
    assert [r.request_id for r in restoring.requests] == ["busy"]
    assert [m[0] for m in restoring.host_moves if m[0] == LOAD] == []
    restored = sum(m[0] == LOAD for m in restoring.host_ahead)
    assert restored > 0 and engine.snapshot()["kv_host_loads"] - loads == restored
    for name, outs in drain(engine).items():
        outputs.setdefault(name, []).extend(outs)
    started = batches[batches.index(restoring) + 1]
    back = next(r for r in started.requests if r.request_id == "back")
    assert back.start_pos == 96  # the next step: its prefix was in the pool
    assert tokens(outputs["back"]) == expected[0] and tokens(outputs["busy"]) == expected[5]
    assert outputs["back"][-1].usage.cached_tokens == 96
    assert engine.snapshot()["kv_host_loads"] - loads == restored  # brought back once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's copy stream")
def test_on_a_gpu_the_copies_beside_run_on_their_own_stream_with_the_same_output(
        tiny_model_dir, conversations):
    plain = _engine(tiny_model_dir, host_mib=0, device="cuda")
    _round(plain, conversations, "a")
    computed, _ = _round(plain, conversations, "b")
    engine = _engine(tiny_model_dir, num_kv_blocks=32, device="cuda")
    assert engine.runner._copy_stream is not None
    _round(engine, conversations, "a")
    # Two at a time: one request's prefix is restored beside the other's steps.
    for i in range(0, 6, 2):
        for j in (i, i + 1):
            engine.add_request(request(f"b{j}", conversations[j], tenant=f"t{j}",
                                       salt=f"t{j}", max_tokens=MAX_NEW, ignore_eos=True))
        outs = drain(engine)
        assert [tokens(outs[f"b{j}"]) for j in (i, i + 1)] == computed[i:i + 2]
    snap = engine.snapshot()
    assert snap["kv_host_loads"] > 0 and snap["kv_host_saves"] > 0


def test_the_tiers_accounting_returns_to_empty(tiny_model_dir, conversations):
    engine = _engine(tiny_model_dir)
    for tag in "abc":
        _round(engine, conversations, tag)
    snap = engine.snapshot()
    assert snap["kv_blocks_used"] == 0  # every block back in the pool's free queue
    host = engine.kv.host
    assert sum(host.used_by(f"t{i}") for i in range(6)) == host.num_used \
        == snap["kv_host_blocks_used"] <= snap["kv_host_blocks_total"]
    assert host.take_moves() == []  # every copy decided was handed to a step
    # but the copies ahead of the last request's blocks, which the next step makes
    assert all(engine.kv.pool.blocks[block].ref_cnt == 0 for _, block, _ in host.take_ahead())
    engine.kv.reset_cache()  # as a failed forward pass does
    assert host.num_used == 0 and engine.kv.pool.cached_keys() == []
    outs, cached = _round(engine, conversations[:2], "d")
    assert cached == [0, 0]


def test_a_small_host_tier_keeps_what_fits_and_the_output_stays_right(
        tiny_model_dir, conversations, expected):
    engine = _engine(tiny_model_dir, host_mib=0.25)
    slots = engine.kv.host.num_slots
    assert 0 < slots < 6 * 6  # fewer than the six prefixes' blocks
    for tag in "ab":
        outs, _ = _round(engine, conversations, tag)
        assert outs == expected
    assert engine.kv.host.num_used == slots and engine.snapshot()["kv_host_evictions"] > 0


@pytest.mark.parametrize("options", [
    {"num_kv_blocks": 20, "block_size": 8, "max_num_batched_tokens": 48},  # preempts
    {"speculative": "ngram", "num_speculative_tokens": 3, "speculative_max_batch": 64,
     "num_kv_blocks": 16, "block_size": 8, "max_num_batched_tokens": 48},
], ids=["preempting", "speculative"])
def test_restores_compose_with_preemption_and_speculation(tiny_model_dir, conversations,
                                                          expected, options):
    engine = _engine(tiny_model_dir, **options)
    for tag in "ab":  # all at once: they preempt each other and restore what was evicted
        for i, prompt in enumerate(conversations):
            engine.add_request(request(f"{tag}{i}", prompt, tenant=f"t{i}", salt=f"t{i}",
                                       max_tokens=MAX_NEW, ignore_eos=True))
        done = drain(engine)
        assert [tokens(done[f"{tag}{i}"]) for i in range(6)] == expected
    snap = engine.snapshot()
    assert snap["kv_host_loads"] > 0
    assert snap["spec_decode_num_drafts"] > 0 if options.get("speculative") \
        else snap["preemptions"] > 0


def test_the_pool_keeps_a_tenants_prefix_while_another_cycles_through_prompts(
        tiny_model_dir, conversations, expected):
    """The first tier is fair too: without a host tier, a tenant whose prompt fits its share
    of the pool finds it again after another tenant's five long prompts."""
    engine = _engine(tiny_model_dir, host_mib=0, num_kv_blocks=24)
    first, _ = _round(engine, conversations[:1], "a", tenant=lambda i: "quiet")
    _round(engine, conversations[1:], "flood", tenant=lambda i: "flood")
    again, cached = _round(engine, conversations[:1], "b", tenant=lambda i: "quiet")
    assert cached == [96] and again == first == expected[:1]


def test_a_restarted_engine_starts_with_empty_tiers(tiny_model_dir, conversations, expected):
    engine = _engine(tiny_model_dir)
    _round(engine, conversations, "a")
    assert engine.kv.host.num_used > 0
    restarted = _engine(tiny_model_dir)
    assert restarted.snapshot()["kv_host_blocks_used"] == 0
    outs, cached = _round(restarted, conversations, "a")
    assert outs == expected and cached == [0] * 6


@pytest.mark.parametrize("retention_s", [86400.0, 0.0])
def test_a_prompt_asked_to_be_kept_outlasts_the_tenants_other_traffic(
        tiny_model_dir, conversations, retention_s):
    engine = _engine(tiny_model_dir, host_mib=0.25)  # room for a few prefixes
    kept = request("kept", conversations[0], tenant="t", salt="t", max_tokens=2,
                   ignore_eos=True)
    kept.cache_retention_s = retention_s
    engine.add_request(kept)
    drain(engine)
    for round_ in range(3):  # its other prompts, many times the tier's size
        _round(engine, conversations[1:], f"other{round_}", tenant=lambda i: "t")
    engine.add_request(request("again", conversations[0], tenant="t", salt="t", max_tokens=2,
                               ignore_eos=True))
    cached = drain(engine)["again"][-1].usage.cached_tokens
    assert cached == 96 if retention_s else cached < 96
