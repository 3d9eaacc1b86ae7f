"""The replica's per-request metric state must not outlive its requests: over a long run every
disconnected or failed request would otherwise leave an entry behind (the soak's memory check)."""

from __future__ import annotations

import pytest

from workers.engine import EngineStats
from workers.metrics import EngineMetrics
from workers.outputs import CompletionOutput, RequestOutput

IDLE = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, {})


def _token(request_id: str, finished: bool = False) -> RequestOutput:
    metrics = {"arrival_time": 0.0, "first_token_time": 0.1, "finished_time": 0.2} if finished else {}
    return RequestOutput(request_id, None, [], [CompletionOutput(0, "x", [7])], finished, metrics=metrics)


def test_finished_requests_leave_no_state() -> None:
    m = EngineMetrics("r0")
    for i in range(50):
        m.observe_step(IDLE, [_token(f"a{i}")], 1.0)
        m.observe_step(IDLE, [_token(f"a{i}", finished=True)], 1.1)
    assert m._last_token_time == {}


def test_request_aborted_while_a_step_runs_leaves_no_state() -> None:
    """The caller goes away (abort queued, `forget` called) while the engine thread is in a step that
    still emits a token for the request: that late output must not leave an entry behind."""
    m = EngineMetrics("r0")
    for i in range(50):
        rid = f"d{i}"
        m.observe_step(IDLE, [_token(rid)], 1.0)
        m.forget(rid)  # from the replica's event loop, racing the engine thread
        m.observe_step(IDLE, [_token(rid)], 1.1)  # the step that was in flight
    m.observe_step(IDLE, [], 1.2)
    assert m._last_token_time == {}


def test_failed_requests_are_forgotten_and_itl_still_recorded() -> None:
    m = EngineMetrics("r0")
    m.observe_step(IDLE, [_token("f")], 1.0)
    m.observe_step(IDLE, [_token("ok")], 1.0)
    m.forget("f")  # failed in the engine: no finished output will come
    m.observe_step(IDLE, [_token("ok")], 1.25)
    assert m._last_token_time == {"ok": 1.25}
    assert m.itl._sum.get() == 0.25


def test_an_output_of_several_steps_counts_one_inter_token_gap_per_step() -> None:
    """With `stream_interval` an output carries several steps' tokens: ITL stays per token."""
    m = EngineMetrics("r0")
    m.observe_step(IDLE, [_token("s")], 1.0)
    m.observe_step(IDLE, [RequestOutput("s", None, [], [CompletionOutput(0, "abcd", [7, 8, 9, 10])], False)], 1.4)
    assert m.itl._sum.get() == pytest.approx(0.4) and sum(b.get() for b in m.itl._buckets) == 4
