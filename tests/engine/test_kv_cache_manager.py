from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from tests.engine.scheduling import seq


def _run_prompt(kv: KVCacheManager, s) -> None:
    """Allocates and 'computes' the whole prompt, as a step would."""
    computed, hit = kv.get_computed_blocks(s)
    assert kv.allocate_slots(s, s.num_tokens - hit, computed)
    s.num_computed_tokens = s.num_tokens
    kv.cache_full_blocks(s, s.num_tokens)


def test_slots_grow_a_block_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = seq(5)
    assert kv.allocate_slots(s, 5)
    assert len(kv.block_table(s)) == 2
    s.num_computed_tokens = 5
    assert kv.allocate_slots(s, 3)  # positions 5..7 fit the second block
    assert len(kv.block_table(s)) == 2
    s.num_computed_tokens = 8
    assert kv.allocate_slots(s, 1)
    assert len(kv.block_table(s)) == 3


def test_allocation_fails_cleanly_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    s = seq(12)
    assert not kv.allocate_slots(s, 12)
    assert kv.num_free_blocks == 2 and kv.block_table(s) == []


def test_same_prefix_same_scope_hits_whole_blocks_only():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 20))  # 10 tokens: two full blocks and a partial one
    first = seq(prompt=prompt)
    _run_prompt(kv, first)
    second = seq(prompt=prompt + [99, 98])
    computed, hit = kv.get_computed_blocks(second)
    assert hit == 8 and [b.block_id for b in computed] == kv.block_table(first)[:2]


def test_a_full_hit_still_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 18))  # exactly two blocks
    _run_prompt(kv, seq(prompt=prompt))
    _, hit = kv.get_computed_blocks(seq(prompt=prompt))
    assert hit == 4


def test_no_hit_across_scopes():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 30))
    _run_prompt(kv, seq(prompt=prompt, scope=b"tenant-a"))
    assert kv.get_computed_blocks(seq(prompt=prompt, scope=b"tenant-b"))[1] == 0
    assert kv.get_computed_blocks(seq(prompt=prompt, scope=b"tenant-a"))[1] == 16


def test_freed_blocks_stay_reusable_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(10, 19))
    first = seq(prompt=prompt)
    _run_prompt(kv, first)
    kv.free(first)
    assert kv.num_free_blocks == 4
    assert kv.get_computed_blocks(seq(prompt=prompt))[1] == 8
    _run_prompt(kv, seq(prompt=list(range(50, 66))))  # needs all four blocks: evicts
    assert kv.get_computed_blocks(seq(prompt=prompt))[1] == 0


def test_a_hit_on_an_unused_block_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    prompt = list(range(10, 19))
    first = seq(prompt=prompt)
    _run_prompt(kv, first)
    kv.free(first)
    second = seq(prompt=prompt + list(range(40, 48)))  # 17 tokens: 5 blocks, 2 of them hits
    computed, hit = kv.get_computed_blocks(second)
    assert hit == 8
    assert not kv.allocate_slots(second, second.num_tokens - hit, computed)
    assert kv.num_free_blocks == 3 and all(b.ref_cnt == 0 for b in computed)


def test_blocks_indexed_for_a_step_that_never_ran_are_forgotten():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10, 22))
    s = seq(prompt=prompt)
    assert kv.allocate_slots(s, 12)
    kv.cache_full_blocks(s, 12)  # scheduled, not yet computed
    assert kv.get_computed_blocks(seq(prompt=prompt + [1]))[1] == 12
    kv.free(s)  # preempted or failed before the step ran: num_computed_tokens is still 0
    assert kv.get_computed_blocks(seq(prompt=prompt + [1]))[1] == 0


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    prompt = list(range(10, 30))
    _run_prompt(kv, seq(prompt=prompt))
    assert kv.get_computed_blocks(seq(prompt=prompt)) == ([], 0)


def _forked(kv: KVCacheManager, prompt_len: int):
    parent = seq(prompt_len)
    _run_prompt(kv, parent)
    child = seq(prompt=parent.token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    return parent, child


def test_a_fork_shares_every_block_of_the_parent():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = _forked(kv, 10)  # two full blocks and one holding 2 tokens
    assert kv.block_table(child) == kv.block_table(parent)
    assert [b.ref_cnt for b in kv.tables[parent.request_id]] == [2, 2, 2]
    assert child.block_hashes == parent.block_hashes and len(child.block_hashes) == 2
    assert kv.num_free_blocks == 5


def test_writing_into_a_shared_partial_block_copies_it_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = _forked(kv, 10)
    shared = kv.block_table(parent)
    assert kv.allocate_slots(child, 1)
    table = kv.block_table(child)
    assert table[:2] == shared[:2] and table[2] != shared[2]
    assert kv.take_copies() == [(shared[2], table[2])]
    assert kv.allocate_slots(parent, 1)  # the last holder writes in place
    assert kv.block_table(parent) == shared and kv.take_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_a_copy_the_pool_cannot_hold_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    parent, child = _forked(kv, 10)
    assert not kv.allocate_slots(child, 1)
    assert kv.block_table(child) == kv.block_table(parent) and kv.take_copies() == []


def test_a_whole_block_prompt_is_never_copied():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = _forked(kv, 8)
    assert kv.allocate_slots(child, 1) and kv.allocate_slots(parent, 1)
    assert kv.take_copies() == []
    assert kv.block_table(child)[:2] == kv.block_table(parent)[:2]
