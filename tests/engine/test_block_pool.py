from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.prefix_hash import hash_block


def test_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block(None, [1, 2, 3, 4], b"tenant-a")
    assert base == hash_block(None, [1, 2, 3, 4], b"tenant-a")
    assert base != hash_block(None, [1, 2, 3, 4], b"tenant-b")
    assert base != hash_block(None, [1, 2, 3, 5], b"tenant-a")
    assert hash_block(base, [5, 6], b"") != hash_block(hash_block(None, [1, 2, 3, 4], b"x"),
                                                        [5, 6], b"")


def test_extra_keys_cannot_be_shifted_into_tokens():
    # Length-prefixed: the extra key b"" plus tokens never equals another key plus fewer tokens.
    assert hash_block(None, [1], b"") != hash_block(None, [], b"\x01\x00\x00\x00\x00\x00\x00\x00")


def test_allocate_takes_references_and_release_returns_them():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1] and pool.num_free == 1
    pool.touch(blocks[:1])
    pool.release(blocks[::-1])
    assert pool.num_free == 3 and blocks[0].ref_cnt == 1
    pool.release(blocks[:1])
    assert pool.num_free == 4


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free == 1


def test_releasing_twice_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError):
        pool.release([block])


def test_unused_cached_blocks_are_evicted_least_recently_released_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache(block, key)
    pool.release([b])
    pool.release([a])
    pool.release([c])
    assert pool.lookup(b"b") is b
    (fresh,) = pool.allocate(1)  # takes the oldest release: b
    assert fresh is b and pool.lookup(b"b") is None and fresh.block_hash is None
    assert pool.lookup(b"a") is a and pool.lookup(b"c") is c


def test_a_cache_hit_on_an_unused_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(2)
    a, _ = pool.allocate(2)
    pool.cache(a, b"a")
    pool.release([a])
    assert pool.num_free == 1
    pool.touch([pool.lookup(b"a")])
    assert pool.num_free == 0 and a.ref_cnt == 1


def test_an_equal_block_is_indexed_once():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"same")
    pool.cache(b, b"same")
    assert pool.lookup(b"same") is a and b.block_hash is None


def test_a_free_block_that_caches_nothing_is_handed_out_before_a_cached_one():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"a")
    pool.release([a, b])  # a, cached, was released first
    assert pool.allocate(1) == [b] and pool.lookup(b"a") is a


def _cycle(pool: BlockPool, tenant: str, weight: float, prompts: int) -> None:
    """A tenant's prompts of one block each, cached and released one after another."""
    for i in range(prompts):
        (block,) = pool.allocate(1)
        pool.cache(block, f"{tenant}{i}".encode(), (tenant, weight, 0.0))
        pool.release([block])


@pytest.mark.parametrize(("weight", "kept"), [(1.0, 4), (4.0, 2)])
def test_a_flooding_tenant_evicts_its_own_cached_blocks_not_anothers_share(weight, kept):
    pool = BlockPool(10)
    quiet = pool.allocate(4)
    for i, block in enumerate(quiet):
        pool.cache(block, b"quiet%d" % i, ("quiet", 1.0, 0.0))
    pool.release(quiet)  # the oldest releases in the pool
    _cycle(pool, "flood", weight, 100)
    # Its share is half the pool at an even weight: its 4 blocks stay; a flood weighed 4
    # to its 1 has four fifths, and takes it down to 2 (its least recently released go).
    assert [pool.lookup(b"quiet%d" % i) is not None for i in range(4)] == \
        [False] * (4 - kept) + [True] * kept
    assert len(pool.cached_keys()) == 10 and pool.num_free == 10
