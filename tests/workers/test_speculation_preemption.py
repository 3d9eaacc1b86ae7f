"""Speculation beside preemption: a request that drafts may lose its blocks in the very `schedule` that gave it
drafts, and random workloads under the priority policy (where that happens) give the outputs they give without
speculation."""

from __future__ import annotations

import pytest

from workers.engine import Engine
from workers.sampling_params import SamplingParams


def test_a_request_preempted_after_its_drafts_were_scheduled_comes_back_without_them():
    """A drafting request that the same `schedule` preempts after giving it drafts (scheduled first, ranked
    last, its drafts took the pool's last block and the next request needs one) gives its drafts back with its
    blocks: re-admitted, it recomputes its tokens, and no draft rides along with them."""
    from workers.kv_cache_manager import KVCacheManager
    from workers.request import Request, RequestStatus
    from workers.request_queue import make_request_queue
    from workers.scheduler import Scheduler, SchedulerConfig

    def request(rid: str, prompt: list[int], arrival: float, priority: int) -> Request:
        return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=20), max_tokens=20, arrival_time=arrival,
                       priority=priority)

    config = SchedulerConfig(8, 64, True, 64, num_speculative_tokens=4)
    sched = Scheduler(config, KVCacheManager(4, 4, False), make_request_queue("priority"))
    low = request("low", [1, 2, 3, 4, 5, 6, 7], 0.0, priority=5)
    sched.add_request(low)
    out = sched.schedule()  # its prompt: 2 blocks
    sched.update_from_output(out, [1])  # ... 7, 1: no earlier match, no drafts
    hi = request("hi", [10, 11, 12, 13], 1.0, priority=0)
    sched.add_request(hi)
    out = sched.schedule()  # low's token (block 2), hi's prompt (a 3rd block): one block left
    assert out.requests == [low, hi] and not low.spec_token_ids
    sched.update_from_output(out, [2, 14])  # low: ... 1, 2 matches its start: drafts 3, 4, ...
    out = sched.schedule()  # low's drafts take the last block; hi needs one: low, ranked last, goes
    assert out.preempted == [low] and out.requests == [hi] and out.num_new_tokens == [1]
    assert low.status is RequestStatus.PREEMPTED and low.block_ids == [] and low.spec_token_ids == []
    sched.update_from_output(out, [15])
    sched.finish_requests([hi], RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()  # low again: its 9 tokens, nothing more
    assert out.requests == [low] and out.num_new_tokens == [9] and low.spec_token_ids == []
    assert out.total_num_tokens == 9


# seeds whose runs preempt a request in the `schedule` that gave it drafts (each fails with `_preempt`'s reset of
# them left out)
@pytest.mark.parametrize("seed", [9, 11, 15, 17])
def test_random_workloads_speculating_on_the_cpu_give_the_outputs_without_speculation(repeating_model_dir, seed):
    """The CPU's serving default (drafts at any batch size, as many as each request's record earns) over a
    random workload (`loadtest/gpu_check/random_workload.py`: arrivals, aborts, preemption, prefix caching, every
    kind of request) under the priority policy, against the same without speculation: the same completions
    (an aborted request's up to the shorter), every block back."""
    from loadtest.gpu_check.random_workload import VARIANTS, compare, engine_options, run, workload

    v = VARIANTS["speculating"]
    reqs = workload(seed, v.cpu_shape, v.kinds, v.priorities)

    def engine(drafts: int) -> Engine:
        return Engine(model=repeating_model_dir, scheduling_policy="priority", attention_backend="torch",
                      **engine_options(v.cpu_shape, drafts))

    reference, _ = run(engine(0), reqs)
    got, ran = run(engine(4), reqs)
    assert ran["kv_usage_after"] == 0 and ran["preemptions"] > 0 and 0 < ran["drafts_kept"] < ran["drafts"], ran
    assert compare(reqs, reference, got, abort_slack=None) == []
