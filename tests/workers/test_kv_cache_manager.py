"""KVCacheManager: on-demand block growth, failure atomicity, prefix caching, sibling sharing, freeing."""

from __future__ import annotations

import pytest

from workers.kv_cache_manager import KVCacheManager
from workers.request import Request
from workers.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], max_tokens: int = 100) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0), max_tokens=max_tokens,
                   arrival_time=0.0)


def compute(kv: KVCacheManager, req: Request, n: int, computed: list[int] | None = None) -> None:
    """What the scheduler + engine do for one chunk: allocate, advance, publish."""
    computed = computed or []
    assert kv.allocate_slots(req, n, computed)
    req.num_computed_tokens += len(computed) * kv.block_size + n
    kv.cache_computed_blocks(req)


def test_rejects_bad_block_size():
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)


def test_blocks_allocated_on_demand_not_up_front():
    kv = KVCacheManager(num_blocks=10, block_size=16)
    req = make_req("a", list(range(17)), max_tokens=100)  # prompt + max_tokens would be 8 blocks
    assert kv.allocate_slots(req, 17)
    assert len(req.block_ids) == 2
    assert kv.pool.num_free_blocks == 8
    req.num_computed_tokens = 17
    # decode steps up to 32 tokens fit in the 2 blocks
    for t in range(17, 32):
        req.append_token(t)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert len(req.block_ids) == 2
    req.append_token(32)  # 33rd token
    assert kv.allocate_slots(req, 1)
    assert len(req.block_ids) == 3
    assert kv.pool.num_free_blocks == 7
    assert len(set(req.block_ids)) == 3


def test_chunked_growth_allocates_only_what_the_chunk_needs():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_req("a", list(range(10)))
    assert kv.allocate_slots(req, 3)
    assert len(req.block_ids) == 1
    req.num_computed_tokens = 3
    assert kv.allocate_slots(req, 2)  # tokens 3..4 -> 2 blocks
    assert len(req.block_ids) == 2
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 5)  # tokens 5..9 -> 3 blocks
    assert len(req.block_ids) == 3


def test_allocation_failure_returns_false_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    other = make_req("o", list(range(8)))
    assert kv.allocate_slots(other, 8)  # 2 blocks taken, 1 free
    req = make_req("a", list(range(8)))
    ref_before = list(kv.pool.ref_cnt)
    assert not kv.allocate_slots(req, 8)
    assert req.block_ids == []
    assert kv.pool.ref_cnt == ref_before
    assert kv.pool.num_free_blocks == 1


def test_allocation_failure_with_prefix_hits_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = make_req("first", list(range(12)))
    compute(kv, first, 12)
    kv.free(first)  # 3 cached evictable blocks + 1 plain free block
    hog = make_req("hog", [99] * 4)
    assert kv.allocate_slots(hog, 4)  # takes the least recently freed block (the uncached one)
    again = make_req("again", list(range(12)) + [50, 51, 52, 53, 54])  # 17 tokens -> 5 blocks
    hits = kv.get_computed_blocks(again)
    assert len(hits) == 3
    ref_before = list(kv.pool.ref_cnt)
    free_before = kv.pool.num_free_blocks
    assert not kv.allocate_slots(again, 5, hits)  # needs 2 more blocks; reviving the 3 leaves 0
    assert again.block_ids == []
    assert kv.pool.ref_cnt == ref_before
    assert kv.pool.num_free_blocks == free_before
    assert kv.get_computed_blocks(again) == hits  # still cached


def test_prefix_cache_hit_after_free_excludes_block_with_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=16)
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    a = make_req("a", prompt)
    compute(kv, a, 40)
    a_blocks = list(a.block_ids)
    kv.free(a)
    assert kv.pool.num_free_blocks == 10

    b = make_req("b", prompt[:40] + [7, 8, 9])
    hits = kv.get_computed_blocks(b)
    assert hits == a_blocks[:2]
    assert kv.allocate_slots(b, b.num_tokens - 32, hits)
    assert b.block_ids[:2] == a_blocks[:2]
    assert kv.pool.ref_cnt[a_blocks[0]] == 1 and kv.pool.ref_cnt[a_blocks[1]] == 1
    assert len(b.block_ids) == 3

    # exactly 32 tokens: the second block holds the last token, so only one block is a hit
    c = make_req("c", prompt[:32])
    assert kv.get_computed_blocks(c) == a_blocks[:1]
    # 33 tokens: both full blocks are hits, the last token is in the third block
    d = make_req("d", prompt[:33])
    assert kv.get_computed_blocks(d) == a_blocks[:2]


def test_prefix_hit_stops_at_first_mismatch():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", list(range(13)))
    compute(kv, a, 13)
    b = make_req("b", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])  # second block differs
    assert kv.get_computed_blocks(b) == a.block_ids[:1]
    c = make_req("c", [42] + list(range(1, 13)))  # first block differs: chained hash misses the rest too
    assert kv.get_computed_blocks(c) == []


def test_hits_on_blocks_held_by_a_running_request_are_ref_counted():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", list(range(9)))
    compute(kv, a, 9)
    b = make_req("b", list(range(9)))
    hits = kv.get_computed_blocks(b)
    assert hits == a.block_ids[:2]
    free_before = kv.pool.num_free_blocks
    assert kv.allocate_slots(b, 1, hits)
    assert [kv.pool.ref_cnt[x] for x in hits] == [2, 2]
    assert kv.pool.num_free_blocks == free_before - 1  # only the tail block is new
    kv.free(a)
    assert [kv.pool.ref_cnt[x] for x in hits] == [1, 1]
    kv.free(b)
    assert kv.pool.num_free_blocks == 10


def test_partially_computed_blocks_are_not_published():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", list(range(12)))
    compute(kv, a, 6)  # one full block computed, second half-done
    b = make_req("b", list(range(12)))
    assert kv.get_computed_blocks(b) == a.block_ids[:1]
    compute(kv, a, 6)
    assert kv.get_computed_blocks(b) == a.block_ids[:2]


def test_shareable_prefix_gives_child_parent_full_prompt_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2
    parent = make_req("p", prompt)
    compute(kv, parent, 10)
    child = make_req("c", prompt)
    shared = kv.shareable_prefix(child, parent)
    assert shared == parent.block_ids[:2]
    assert [kv.pool.ref_cnt[b] for b in parent.block_ids] == [1, 1, 1]  # nothing taken until allocated
    assert kv.allocate_slots(child, 2, shared)
    assert [kv.pool.ref_cnt[b] for b in parent.block_ids] == [2, 2, 1]
    assert len(child.block_ids) == 3 and child.block_ids[:2] == shared and child.block_ids[2] != parent.block_ids[2]
    kv.free(parent)
    assert [kv.pool.ref_cnt[b] for b in child.block_ids] == [1, 1, 1]
    kv.free(child)
    assert kv.pool.num_free_blocks == 10


def test_shareable_prefix_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(8))  # exactly 2 blocks: the second holds the last token
    parent = make_req("p", prompt)
    compute(kv, parent, 8)
    child = make_req("c", prompt)
    assert kv.shareable_prefix(child, parent) == parent.block_ids[:1]


def test_shareable_prefix_works_without_prefix_caching():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    parent = make_req("p", list(range(9)))
    compute(kv, parent, 9)
    child = make_req("c", list(range(9)))
    shared = kv.shareable_prefix(child, parent)
    assert shared == parent.block_ids[:2]
    assert kv.allocate_slots(child, 1, shared)
    assert [kv.pool.ref_cnt[b] for b in child.block_ids[:2]] == [2, 2]


def test_prefix_caching_disabled_returns_no_hits():
    kv = KVCacheManager(num_blocks=10, block_size=16, enable_prefix_caching=False)
    prompt = list(range(40))
    a = make_req("a", prompt)
    compute(kv, a, 40)
    b = make_req("b", prompt)
    assert kv.get_computed_blocks(b) == []  # not even while `a` holds the blocks
    kv.free(a)
    assert kv.get_computed_blocks(b) == []
    kv.record_prefix_query(b, 0)
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0


def test_prefix_stats():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", list(range(9)))
    kv.record_prefix_query(a, 4)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 4)


def test_evicted_prefix_is_no_longer_a_hit():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_req("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    hog = make_req("hog", [7] * 12)
    assert kv.allocate_slots(hog, 12)  # reuses all 3 blocks, evicting the cache
    b = make_req("b", list(range(9)))
    assert kv.get_computed_blocks(b) == []


def test_free_returns_everything_and_prefers_evicting_suffix_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_req("a", list(range(13)))
    compute(kv, a, 13)
    blocks = list(a.block_ids)
    assert kv.pool.num_free_blocks == 2
    kv.free(a)
    assert a.block_ids == []
    assert kv.pool.num_free_blocks == 6
    assert all(r == 0 for r in kv.pool.ref_cnt)
    assert kv.usage == 0.0
    # freed tail first: after the 2 never-used blocks, the tail block is evicted before the prefix
    taken = kv.pool.allocate(3)
    assert taken[2] == blocks[3]
    b = make_req("b", list(range(13)))
    assert kv.get_computed_blocks(b) == blocks[:3]


def test_free_of_a_request_with_published_hashes_resets_its_state():
    """A preempted request recomputes from scratch: stale hashes must not leak into the next run."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_req("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    a.num_computed_tokens = 0
    hits = kv.get_computed_blocks(a)
    assert len(hits) == 2
    compute(kv, a, 1, hits)
    assert a.num_computed_tokens == 9
    assert [kv.pool.ref_cnt[b] for b in a.block_ids] == [1, 1, 1]
