"""`StepCosts`: the rows' share of a decode step's time, fitted to the engine's steps, and the odds a draft needs
beside other requests that the scheduler takes from it (`Scheduler.keep_odds`)."""

from __future__ import annotations

import math

import pytest

from workers.kv_cache_manager import KVCacheManager
from workers.request_queue import make_request_queue
from workers.scheduler import (SPEC_KEEP_ODDS, SPEC_MAX_KEEP_ODDS, SPEC_MIN_KEEP_ODDS, Scheduler,
                               SchedulerConfig)
from workers.step_costs import MIN_WEIGHT, StepCosts


def _fed(costs: StepCosts, rows: list[int], intercept: float, slope: float) -> StepCosts:
    for n in rows:
        costs.observe(n, intercept + slope * n)
    return costs


def test_a_line_through_the_steps_gives_the_rows_share():
    """Steps on a line T = a + b * rows: the share at n rows is b * n / T(n), exactly, once enough steps with
    rows that vary came in; before that, none."""
    costs = StepCosts()
    rows = [16, 18, 17, 20, 16, 19, 21, 16, 18, 22] * 3
    for i, n in enumerate(rows):
        costs.observe(n, 0.020 + 0.003 * n)
        if i + 1 < MIN_WEIGHT:
            assert costs.row_share(16) is None
    assert costs.row_share(16) == pytest.approx(0.003 * 16 / (0.020 + 0.003 * 16))
    assert costs.row_share(4) == pytest.approx(0.003 * 4 / (0.020 + 0.003 * 4))  # the line, further down
    # rows that cost nothing: no share; rows that are the whole step: all of it
    assert _fed(StepCosts(), rows, 0.05, 0.0).row_share(16) == pytest.approx(0.0, abs=1e-9)
    assert _fed(StepCosts(), rows, 0.0, 0.004).row_share(16) == pytest.approx(1.0)


def test_the_latest_steps_count_and_rows_that_do_not_vary_keep_the_last_slope():
    costs = _fed(StepCosts(), [8, 10, 12, 9, 11] * 4, 0.030, 0.001)
    # the machine got slower per row: the fit follows within a few dozen steps
    _fed(costs, [8, 10, 12, 9, 11] * 20, 0.030, 0.004)
    assert costs.row_share(10) == pytest.approx(0.004 * 10 / (0.030 + 0.004 * 10), rel=5e-3)
    # a batch of the same rows step after step says nothing of a row's cost: the slope stays near the last one
    # fitted over rows that varied (the steps as the spread fades move it a little), the step's time there
    # follows the steps
    _fed(costs, [10] * 200, 0.090, 0.0)
    assert costs.row_share(10) == pytest.approx(0.004 * 10 / 0.090, rel=0.15)
    # with rows that never varied there is no slope at all
    assert _fed(StepCosts(), [10] * 50, 0.05, 0.0).row_share(10) is None


def test_steps_of_no_rows_or_no_time_are_ignored():
    costs = StepCosts()
    for n, s in [(0, 0.1), (5, 0.0), (5, -1.0), (5, math.nan)] * 10:
        costs.observe(n, s)
    assert costs.row_share(5) is None


def _scheduler(num_speculative_tokens: int, running: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, enable_chunked_prefill=True,
                             max_model_len=512, num_speculative_tokens=num_speculative_tokens)
    s = Scheduler(config, KVCacheManager(64, 16, False), make_request_queue("fcfs", None))
    s.running = [object()] * running  # `keep_odds` reads the batch's size only
    return s


def test_keep_odds_follow_the_rows_share_within_bounds():
    s = _scheduler(4, running=16)
    assert s.keep_odds() == SPEC_KEEP_ODDS  # the steps have not told yet
    rows = [16, 18, 17, 20, 16, 19, 21, 16, 18, 22] * 3
    _fed(s.step_costs, rows, 0.020, 0.003)
    assert s.keep_odds() == pytest.approx(0.003 * 16 / 0.068)
    s.step_costs = _fed(StepCosts(), rows, 0.0, 0.004)  # rows are the whole step
    assert s.keep_odds() == SPEC_MAX_KEEP_ODDS
    s.step_costs = _fed(StepCosts(), rows, 0.05, 0.0)  # rows are free: drafts still need some odds
    assert s.keep_odds() == SPEC_MIN_KEEP_ODDS
    assert _scheduler(0, running=16).step_costs is None  # no speculation: nothing to learn
