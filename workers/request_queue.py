"""Scheduling policies as waiting-queue classes. Each queue orders requests by `key` (smaller is served
first); the scheduler preempts the running request with the largest key."""

from __future__ import annotations

import enum
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from workers.request import Request


class SchedulingPolicy(str, enum.Enum):
    """The waiting-queue orders; the one list of their names, which options, help and errors read."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    SJF = "sjf"
    PREDICTED = "predicted"

    @classmethod
    def names(cls) -> list[str]:
        return [p.value for p in cls]


class RequestQueue(ABC):
    @abstractmethod
    def key(self, request: Request) -> tuple: ...

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put back a preempted request so it is served before newcomers of equal standing."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def on_finished(self, request: Request) -> None:
        """Called by the scheduler when a request finishes (not aborted); policies may learn from it."""


class FCFSQueue(RequestQueue):
    """First come, first served; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class HeapQueue(RequestQueue):
    """A min-heap on `key`; ties go to the earlier insertion."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key(request), next(self._counter), request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._heap))


class PriorityQueue(HeapQueue):
    """Lower `priority` value first (vLLM's convention), then arrival."""

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)


class SJFQueue(HeapQueue):
    """Shortest job first, the job being prompt plus `max_tokens`."""

    def key(self, request: Request) -> tuple:
        return (request.num_prompt_tokens + request.max_tokens, request.arrival_time)


class LengthPredictor(Protocol):
    def predict(self, request: Request) -> float:
        """Expected number of output tokens."""

    def observe(self, request: Request) -> None:
        """Learn from a finished request."""


class MeanLengthPredictor:
    """Default predictor: an exponential moving average of finished requests' output lengths, capped by
    the request's own `max_tokens`."""

    def __init__(self, initial: float = 64.0, alpha: float = 0.05) -> None:
        self.mean = initial
        self.alpha = alpha

    def predict(self, request: Request) -> float:
        return min(float(request.max_tokens), self.mean)

    def observe(self, request: Request) -> None:
        self.mean += self.alpha * (request.num_output_tokens - self.mean)


class PredictedLengthQueue(HeapQueue):
    """Shortest predicted job first, with linear aging so nothing starves: a request that has waited
    `t` seconds longer than another is ranked as if `aging_rate * t` tokens shorter. Since every request
    ages at the same rate, the key `cost + aging_rate * arrival_time` never needs updating."""

    def __init__(self, predictor: LengthPredictor | None = None, aging_rate: float = 20.0) -> None:
        super().__init__()
        self.predictor = predictor or MeanLengthPredictor()
        self.aging_rate = aging_rate

    def key(self, request: Request) -> tuple:
        return (request.predicted_cost + self.aging_rate * request.arrival_time, request.arrival_time)

    def add(self, request: Request) -> None:
        if request.num_preemptions == 0:
            request.predicted_cost = self.predictor.predict(request)
        super().add(request)

    def on_finished(self, request: Request) -> None:
        self.predictor.observe(request)


def make_request_queue(policy: SchedulingPolicy | str, predictor: LengthPredictor | None = None) -> RequestQueue:
    policy = SchedulingPolicy(policy)
    if policy is SchedulingPolicy.FCFS:
        return FCFSQueue()
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityQueue()
    if policy is SchedulingPolicy.SJF:
        return SJFQueue()
    return PredictedLengthQueue(predictor)
