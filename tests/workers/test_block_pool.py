"""BlockPool: ref counts, LRU free list, prefix-cache lookup with collision guard, usage."""

from __future__ import annotations

import pytest

from workers.block_pool import BlockPool, hash_block


def key(parent, tokens):
    return (parent, tuple(tokens))


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_sets_ref_count_one_and_removes_from_free_list():
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert len(got) == 3 and len(set(got)) == 3
    assert all(pool.ref_cnt[b] == 1 for b in got)
    assert pool.num_free_blocks == 1
    (left,) = [b for b in range(4) if b not in got]
    assert pool.ref_cnt[left] == 0
    # the last free block is the one handed out next
    assert pool.allocate(1) == [left]
    assert pool.num_free_blocks == 0


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    before = (list(pool.ref_cnt), pool.num_free_blocks)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert (list(pool.ref_cnt), pool.num_free_blocks) == before


def test_touch_and_release_count_references():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert pool.ref_cnt[b] == 2
    pool.release([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free_blocks == 1  # still held
    assert not pool.is_evictable(b)
    pool.release([b])
    assert pool.ref_cnt[b] == 0 and pool.num_free_blocks == 2
    assert pool.is_evictable(b)


def test_touch_revives_a_free_block():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.release([b])
    assert pool.num_free_blocks == 3
    pool.touch([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free_blocks == 2
    # the revived block is not handed out again
    assert b not in pool.allocate(2)


def test_lru_least_recently_released_is_reused_first():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.release([c])
    pool.release([a])
    pool.release([d])
    pool.release([b])
    assert pool.allocate(4) == [c, a, d, b]


def test_lru_release_order_within_one_call_and_revive_moves_to_back():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.release([b, c, a])  # b oldest
    pool.touch([b])          # b in use again
    pool.release([b])        # ...and now the most recently freed
    assert pool.allocate(3) == [c, a, b]


def test_cached_block_stays_findable_after_release_until_reused():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    toks = [1, 2, 3, 4]
    h = hash_block(None, toks)
    pool.cache(b, h, key(None, toks))
    assert pool.lookup(h, key(None, toks)) == b
    pool.release([b])
    assert pool.lookup(h, key(None, toks)) == b  # free but still cached
    # allocating the *other* free block first does not evict it
    (other,) = pool.allocate(1)
    assert other != b
    assert pool.lookup(h, key(None, toks)) == b
    # reusing b evicts it
    assert pool.allocate(1) == [b]
    assert pool.lookup(h, key(None, toks)) is None
    # and after eviction the block can be cached again under a new hash
    toks2 = [5, 6, 7, 8]
    h2 = hash_block(None, toks2)
    pool.cache(b, h2, key(None, toks2))
    assert pool.lookup(h2, key(None, toks2)) == b


def test_cache_reuse_touch_does_not_evict():
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    h = hash_block(None, [9])
    pool.cache(b, h, key(None, [9]))
    pool.release([b])
    pool.touch([b])  # a prefix hit revives it without eviction
    assert pool.lookup(h, key(None, [9])) == b


def test_lookup_refuses_hash_collision():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    real = key(None, (1, 2, 3, 4))
    crafted_hash = 12345
    pool.cache(b, crafted_hash, real)
    assert pool.lookup(crafted_hash, real) == b
    # same hash, different tokens
    assert pool.lookup(crafted_hash, key(None, (1, 2, 3, 5))) is None
    # same hash and tokens, different parent
    assert pool.lookup(crafted_hash, key(777, (1, 2, 3, 4))) is None
    # unknown hash
    assert pool.lookup(crafted_hash + 1, real) is None


def test_cache_does_not_overwrite_existing_entry():
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    k = key(None, (1,))
    pool.cache(a, 42, k)
    pool.cache(b, 42, k)  # same hash from another block: first one wins
    assert pool.lookup(42, k) == a
    pool.cache(a, 43, key(None, (2,)))  # a block already cached keeps its first hash
    assert pool.lookup(43, key(None, (2,))) is None
    assert pool.lookup(42, k) == a


def test_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.cache(b, 1, key(None, (1,)))
    assert pool.lookup(1, key(None, (1,))) is None


def test_usage_fraction():
    pool = BlockPool(4)
    assert pool.usage == 0.0
    got = pool.allocate(3)
    assert pool.usage == pytest.approx(0.75)
    pool.touch(got[:1])  # a shared block counts once
    assert pool.usage == pytest.approx(0.75)
    pool.cache(got[1], 5, key(None, (5,)))
    pool.release(got[1:])  # an evictable cached block counts as free
    assert pool.usage == pytest.approx(0.25)
    pool.release(got[:1])
    assert pool.usage == pytest.approx(0.25)
    pool.release(got[:1])
    assert pool.usage == 0.0


def test_release_twice_is_caught():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([b])
    assert pool.ref_cnt[b] == 0 and pool.num_free_blocks == 2


def test_release_of_never_allocated_block_is_caught():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.release([1])
