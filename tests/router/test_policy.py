"""The routing decision, without Ray: least outstanding work first, prefix affinity for near-ties."""

from __future__ import annotations

from router.policy import (AFFINITY_SLACK_TOKENS, TOKENS_PER_ONGOING_REQUEST, PrefixAffinity, ReplicaLoad,
                           rank_replicas)


def test_least_pending_tokens_first():
    loads = [ReplicaLoad("a", pending_tokens=900), ReplicaLoad("b", pending_tokens=100), ReplicaLoad("c", pending_tokens=500)]
    assert rank_replicas(loads) == ["b", "c", "a"]


def test_ongoing_requests_count_as_work():
    loads = [ReplicaLoad("a", pending_tokens=0, ongoing_requests=10), ReplicaLoad("b", pending_tokens=100)]
    assert 10 * TOKENS_PER_ONGOING_REQUEST > 100
    assert rank_replicas(loads)[0] == "b"


def test_kv_pressure_goes_last_even_when_idle():
    loads = [ReplicaLoad("full", kv_cache_usage=0.99), ReplicaLoad("busy", pending_tokens=5000)]
    assert rank_replicas(loads) == ["busy", "full"]
    assert rank_replicas(loads, affinity="full") == ["busy", "full"]  # affinity never overrides pressure


def test_affinity_breaks_near_ties_only():
    loads = [ReplicaLoad("a", pending_tokens=0), ReplicaLoad("b", pending_tokens=AFFINITY_SLACK_TOKENS - 1)]
    assert rank_replicas(loads, affinity="b") == ["b", "a"]
    far = [ReplicaLoad("a", pending_tokens=0), ReplicaLoad("b", pending_tokens=AFFINITY_SLACK_TOKENS + 1)]
    assert rank_replicas(far, affinity="b") == ["a", "b"]
    assert rank_replicas(loads, affinity="gone") == ["a", "b"]


def test_equal_loads_are_ordered_deterministically():
    loads = [ReplicaLoad("b"), ReplicaLoad("a")]
    assert rank_replicas(loads) == ["a", "b"]
    assert rank_replicas([]) == []


def test_prefix_affinity_longest_match_and_liveness():
    aff = PrefixAffinity(lengths=(4, 8))
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    aff.record(system + [100], "r1")
    aff.record([1, 2, 3, 4, 9, 9, 9, 9, 9], "r2")  # shares only the first 4 tokens
    assert aff.lookup(system + [200, 201]) == "r1"  # the 8-token prefix wins over the 4-token one
    assert aff.lookup([1, 2, 3, 4, 0, 0, 0, 0]) == "r2"
    assert aff.lookup([1, 2, 3]) is None  # shorter than any remembered prefix
    assert aff.lookup(system, live={"r2"}) == "r2"  # r1 gone: fall back to the shorter match
    aff.forget("r2")
    assert aff.lookup([1, 2, 3, 4, 0, 0, 0, 0]) is None


def test_prefix_affinity_is_bounded():
    aff = PrefixAffinity(capacity=3, lengths=(2,))
    for i in range(10):
        aff.record([i, i], f"r{i}")
    assert aff.lookup([0, 0]) is None and aff.lookup([9, 9]) == "r9"
