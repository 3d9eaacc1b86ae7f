"""`execute_isolating` without a model: a fake `execute` that fails for chosen requests or batch sizes."""

from __future__ import annotations

import pytest

from workers.request import Request
from workers.sampler import SampleOutput
from workers.sampling_params import SamplingParams
from workers.scheduler import SchedulerOutput
from workers.step_isolation import RequestsFailed, execute_isolating


def _batch(n: int, chunk_of: dict[int, int] | None = None) -> SchedulerOutput:
    """`n` requests of 4 prompt tokens; request i gets `chunk_of[i]` of them (default all: it samples)."""
    reqs = [Request(f"r{i}", [1, 2, 3, 4], SamplingParams(), 8) for i in range(n)]
    chunk_of = chunk_of or {}
    return SchedulerOutput(reqs, [chunk_of.get(i, 4) for i in range(n)])


def _fake_execute(poison: set[str] = frozenset(), named: set[str] = frozenset(), max_batch: int = 10**9):
    calls: list[list[str]] = []

    def execute(sched: SchedulerOutput) -> SampleOutput:
        ids = [r.request_id for r in sched.requests]
        calls.append(ids)
        if named & set(ids):
            raise RequestsFailed({rid: "cannot prepare" for rid in named & set(ids)})
        if poison & set(ids):
            raise OverflowError("Overflow when unpacking long long")
        if len(ids) > max_batch:
            raise MemoryError("batch too large")
        rows = [sched.requests[i] for i in sched.sample_rows()]
        return SampleOutput([int(r.request_id[1:]) for r in rows], [None] * len(rows))

    return execute, calls


def _ids(step) -> list[str]:
    return [r.request_id for r in step.sched.requests]


def test_no_failure_runs_once():
    execute, calls = _fake_execute()
    step = execute_isolating(execute, _batch(5))
    assert len(calls) == 1 and not step.failed and step.output.token_ids == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad", [{"r0"}, {"r6"}, {"r2", "r5"}, {f"r{i}" for i in range(7)}])
def test_bisection_fails_exactly_the_culprits_and_keeps_batch_order(bad):
    execute, _ = _fake_execute(poison=bad)
    step = execute_isolating(execute, _batch(7))
    assert {r.request_id for r in step.failed} == bad
    assert all("Overflow" in msg for msg in step.failed.values())
    good = [f"r{i}" for i in range(7) if f"r{i}" not in bad]
    assert _ids(step) == good and step.output.token_ids == [int(r[1:]) for r in good]


def test_named_failures_skip_bisection():
    execute, calls = _fake_execute(named={"r3"})
    step = execute_isolating(execute, _batch(6))
    assert [(r.request_id, msg) for r, msg in step.failed.items()] == [("r3", "cannot prepare")]
    assert len(calls) == 2 and calls[1] == ["r0", "r1", "r2", "r4", "r5"]
    assert _ids(step) == ["r0", "r1", "r2", "r4", "r5"]


def test_a_batch_that_only_fails_whole_runs_in_parts_with_no_failure():
    execute, _ = _fake_execute(max_batch=2)
    step = execute_isolating(execute, _batch(7))
    assert not step.failed and _ids(step) == [f"r{i}" for i in range(7)]
    assert step.output.token_ids == list(range(7))


def test_without_drops_requests_and_their_rows_only():
    execute, _ = _fake_execute(poison={"r1"})
    step = execute_isolating(execute, _batch(5, chunk_of={2: 2}))  # r2 is mid-prefill: it does not sample
    assert step.output.token_ids == [0, 3, 4]
    by_id = {r.request_id: r for r in step.sched.requests}
    kept = step.without({by_id["r2"], by_id["r3"]})
    assert _ids(kept) == ["r0", "r4"] and kept.output.token_ids == [0, 4] and kept.sched.num_new_tokens == [4, 4]
