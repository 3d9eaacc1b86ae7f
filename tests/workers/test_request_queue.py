"""Waiting-queue policies: FCFS, priority, SJF, predicted length with aging, and the mean predictor."""

from __future__ import annotations

import pytest

from workers.request import Request
from workers.request_queue import (FCFSQueue, MeanLengthPredictor, PredictedLengthQueue, PriorityQueue, SJFQueue,
                                   SchedulingPolicy, make_request_queue)
from workers.sampling_params import SamplingParams


def req(rid: str, arrival: float, prompt_len: int = 4, max_tokens: int = 8, priority: int = 0) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   max_tokens=max_tokens, arrival_time=arrival, priority=priority)


def drain(q) -> list[str]:
    out = []
    while len(q):
        assert q.peek() is q.peek()
        top = q.peek()
        assert q.pop() is top
        out.append(top.request_id)
    return out


def test_factory():
    assert isinstance(make_request_queue("fcfs"), FCFSQueue)
    assert isinstance(make_request_queue(SchedulingPolicy.PRIORITY), PriorityQueue)
    assert isinstance(make_request_queue("sjf"), SJFQueue)
    assert isinstance(make_request_queue("predicted"), PredictedLengthQueue)
    with pytest.raises(ValueError):
        make_request_queue("lifo")


def test_fcfs_order_prepend_remove_iter():
    q = FCFSQueue()
    a, b, c, d = (req(x, i) for i, x in enumerate("abcd"))
    for r in (a, b, c):
        q.add(r)
    assert [r.request_id for r in q] == ["a", "b", "c"]
    q.prepend(d)  # a preempted request goes to the front regardless of arrival
    assert q.peek() is d
    q.remove(b)
    assert len(q) == 3 and b not in q
    assert drain(q) == ["d", "a", "c"]
    assert q.key(a) < q.key(b)


def test_priority_lower_value_first_ties_by_arrival():
    q = PriorityQueue()
    rs = [req("late-hi", 5, priority=-1), req("early-lo", 0, priority=3), req("mid-0", 2, priority=0),
          req("early-0", 1, priority=0), req("later-0", 3, priority=0)]
    for r in rs:
        q.add(r)
    assert [r.request_id for r in q] == ["late-hi", "early-0", "mid-0", "later-0", "early-lo"]
    assert drain(q) == ["late-hi", "early-0", "mid-0", "later-0", "early-lo"]


def test_priority_same_key_keeps_insertion_order_and_prepend_is_by_key():
    q = PriorityQueue()
    a, b = req("a", 1), req("b", 1)
    q.add(a)
    q.add(b)
    c = req("c", 0, priority=5)
    q.prepend(c)  # heap queues reinsert by key: a low-priority preempted request stays behind
    assert drain(q) == ["a", "b", "c"]


def test_priority_remove_keeps_heap_valid():
    q = PriorityQueue()
    rs = [req(str(i), i, priority=(7 * i) % 5) for i in range(10)]
    for r in rs:
        q.add(r)
    q.remove(rs[3])
    q.remove(rs[0])
    expect = [r.request_id for r in sorted(rs, key=lambda r: (r.priority, r.arrival_time)) if r not in (rs[0], rs[3])]
    assert drain(q) == expect


def test_sjf_by_prompt_plus_max_tokens():
    q = SJFQueue()
    rs = [req("p10m10", 0, 10, 10), req("p2m30", 1, 2, 30), req("p25m1", 2, 25, 1), req("p1m5", 3, 1, 5),
          req("p5m1", 4, 5, 1)]
    for r in rs:
        q.add(r)
    # totals: 20, 32, 26, 6, 6 -> ties broken by arrival
    assert drain(q) == ["p1m5", "p5m1", "p10m10", "p25m1", "p2m30"]


class StubPredictor:
    def __init__(self, table: dict[str, float]) -> None:
        self.table = table
        self.calls: list[str] = []

    def predict(self, request: Request) -> float:
        self.calls.append(request.request_id)
        return self.table[request.request_id]

    def observe(self, request: Request) -> None:  # pragma: no cover - not used here
        pass


def test_predicted_orders_by_predicted_length():
    pred = StubPredictor({"a": 300.0, "b": 5.0, "c": 50.0, "d": 5.0})
    q = PredictedLengthQueue(pred, aging_rate=0.0)
    for i, rid in enumerate("abcd"):
        q.add(req(rid, i, prompt_len=1, max_tokens=1000))
    assert drain(q) == ["b", "d", "c", "a"]
    assert sorted(pred.calls) == ["a", "b", "c", "d"]


def test_predicted_ignores_prompt_and_max_tokens():
    pred = StubPredictor({"long-prompt": 1.0, "short-prompt": 100.0})
    q = PredictedLengthQueue(pred, aging_rate=0.0)
    q.add(req("short-prompt", 0, prompt_len=1, max_tokens=1))
    q.add(req("long-prompt", 1, prompt_len=500, max_tokens=500))
    assert drain(q) == ["long-prompt", "short-prompt"]


@pytest.mark.parametrize("aging_rate", [20.0, 2.5])
def test_predicted_aging_both_sides_of_the_threshold(aging_rate):
    long_cost, short_cost = 500.0, 100.0
    gap = (long_cost - short_cost) / aging_rate  # waiting this long offsets the predicted difference

    def winner(delta: float) -> str:
        pred = StubPredictor({"long": long_cost, "short": short_cost})
        q = PredictedLengthQueue(pred, aging_rate=aging_rate)
        q.add(req("short", 1000.0 + delta, max_tokens=1000))  # newcomer added first
        q.add(req("long", 1000.0, max_tokens=1000))
        return q.peek().request_id

    assert winner(gap * 0.5) == "short"
    assert winner(gap - 0.01) == "short"
    assert winner(gap + 0.01) == "long"
    assert winner(gap * 3) == "long"
    assert winner(gap) == "long"  # exact tie: the earlier arrival wins


def test_predicted_preempted_request_keeps_its_prediction():
    pred = StubPredictor({"a": 10.0})
    q = PredictedLengthQueue(pred, aging_rate=1.0)
    a = req("a", 0)
    q.add(a)
    q.pop()
    pred.table["a"] = 999.0  # a re-prediction would change its rank
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    q.prepend(a)
    assert a.predicted_cost == 10.0
    assert pred.calls == ["a"]


def test_mean_predictor_default_caps_by_max_tokens():
    p = MeanLengthPredictor(initial=64.0)
    assert p.predict(req("a", 0, max_tokens=10)) == 10.0
    assert p.predict(req("b", 0, max_tokens=1000)) == 64.0


def test_mean_predictor_observe_moves_the_mean():
    p = MeanLengthPredictor(initial=64.0, alpha=0.5)
    done = req("a", 0, prompt_len=3, max_tokens=1000)
    for t in range(16):
        done.append_token(t)
    p.observe(done)
    assert p.mean == pytest.approx(40.0)  # 64 + 0.5 * (16 - 64)
    big = req("b", 0, prompt_len=3, max_tokens=1000)
    for t in range(200):
        big.append_token(t)
    p.observe(big)
    assert p.mean == pytest.approx(120.0)  # 40 + 0.5 * (200 - 40)
    assert p.predict(req("c", 0, max_tokens=1000)) == pytest.approx(120.0)


def test_mean_predictor_converges():
    p = MeanLengthPredictor(initial=64.0, alpha=0.05)
    done = req("a", 0, prompt_len=2, max_tokens=1000)
    for t in range(8):
        done.append_token(t)
    for _ in range(300):
        p.observe(done)
    assert p.mean == pytest.approx(8.0, abs=0.01)


def test_predicted_queue_with_default_predictor_learns():
    q = PredictedLengthQueue(aging_rate=0.0)
    done = req("done", 0, prompt_len=1, max_tokens=1000)
    for t in range(4):
        done.append_token(t)
    for _ in range(200):
        q.predictor.observe(done)
    a = req("a", 0, max_tokens=1000)
    q.add(a)
    assert a.predicted_cost == pytest.approx(4.0, abs=0.01)
