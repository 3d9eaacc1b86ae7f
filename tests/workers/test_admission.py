"""The admission rule of `workers/admission.py`, on hand-made loads."""

from __future__ import annotations

import pytest

from workers.admission import AdmissionPolicy, ReplicaLoad, ShedReason

CAPACITY = 1000


def load(running: int = 0, waiting: int = 0, pending: int = 0, free: int = CAPACITY) -> ReplicaLoad:
    return ReplicaLoad(num_running=running, num_waiting=waiting, num_pending_tokens=pending, num_free_kv_tokens=free,
                       kv_capacity_tokens=CAPACITY)


def test_zero_limit_admits_what_can_start_now():
    policy = AdmissionPolicy(max_waiting_requests=0, max_num_seqs=4)
    assert policy.check(load(), num_seqs=1, num_prompt_tokens=8) is None
    assert policy.check(load(running=3), 1, 8) is None
    assert policy.check(load(running=2, waiting=1), 1, 8) is None
    assert policy.check(load(running=4), 1, 8) is ShedReason.QUEUE_FULL
    assert policy.check(load(running=2, waiting=2), 1, 8) is ShedReason.QUEUE_FULL


def test_limit_counts_waiting_beyond_free_slots():
    policy = AdmissionPolicy(max_waiting_requests=3, max_num_seqs=4)
    assert policy.check(load(running=4, waiting=2), 1, 8) is None
    assert policy.check(load(running=4, waiting=3), 1, 8) is ShedReason.QUEUE_FULL
    assert policy.check(load(running=1, waiting=5), 1, 8) is None  # 5 + 1 <= 3 + 3 free slots
    assert policy.check(load(running=1, waiting=6), 1, 8) is ShedReason.QUEUE_FULL
    assert policy.check(load(running=9, waiting=3), 1, 8) is ShedReason.QUEUE_FULL  # preempted back: no negative slots


def test_n_counts_as_n_sequences_capped_by_max_num_seqs():
    policy = AdmissionPolicy(max_waiting_requests=0, max_num_seqs=4)
    assert policy.check(load(running=1), num_seqs=3, num_prompt_tokens=8) is None
    assert policy.check(load(running=2), num_seqs=3, num_prompt_tokens=8) is ShedReason.QUEUE_FULL
    assert policy.check(load(), num_seqs=100, num_prompt_tokens=8) is None  # an idle replica takes any n
    assert policy.check(load(running=1), num_seqs=100, num_prompt_tokens=8) is ShedReason.QUEUE_FULL


def test_kv_room_for_the_backlog_and_the_prompt():
    policy = AdmissionPolicy(max_waiting_requests=0, max_num_seqs=4)
    assert policy.check(load(running=1, pending=90, free=100), 1, 10) is None
    assert policy.check(load(running=1, pending=91, free=100), 1, 10) is ShedReason.KV_CACHE_FULL
    assert policy.check(load(running=1, free=5), 1, 10) is ShedReason.KV_CACHE_FULL
    assert policy.check(load(), 1, 5 * CAPACITY) is None  # a prompt larger than the cache still starts when idle
    roomy = AdmissionPolicy(max_waiting_requests=2, max_num_seqs=4)
    assert roomy.check(load(running=4, free=0), 1, 10) is None  # the queue limit still lets it wait


def test_kv_reason_only_when_a_slot_is_free():
    policy = AdmissionPolicy(max_waiting_requests=0, max_num_seqs=4)
    assert policy.check(load(running=4, free=0), 1, 10) is ShedReason.QUEUE_FULL


def test_no_limit_admits_everything():
    policy = AdmissionPolicy(max_waiting_requests=None, max_num_seqs=1)
    assert policy.check(load(running=50, waiting=10_000, free=0), 128, 10_000) is None


@pytest.mark.parametrize("kwargs", [dict(max_waiting_requests=-1, max_num_seqs=4),
                                    dict(max_waiting_requests=0, max_num_seqs=0)])
def test_invalid_limits_are_refused(kwargs):
    with pytest.raises(ValueError, match="must be >="):
        AdmissionPolicy(**kwargs)
