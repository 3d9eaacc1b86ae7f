"""Running one step so that a request that breaks it fails alone and the rest of the batch goes on.

A step that raises is split: requests the model runner names (`RequestsFailed`: their own part of the
step could not be prepared) are dropped and the rest is run again; otherwise the batch is bisected, each
half run on its own, down to the single requests that fail by themselves. Every request that does not
fail is run successfully exactly once, so its tokens are the ones it would have had in the whole batch.
Nothing here touches the scheduler: a failed attempt advanced no request (the scheduler applies a step
only from its output), and the KV it wrote for the step's tokens is written again by the run that succeeds."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.request import Request
from workers.sampler import SampleOutput
from workers.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class RequestsFailed(Exception):
    """Raised by the model runner when it could not prepare some requests' part of a step (e.g. a seeded
    generator or a ban list); `failures` maps each such request id to its error message."""

    def __init__(self, failures: dict[str, str]) -> None:
        super().__init__("; ".join(f"{rid}: {msg}" for rid, msg in failures.items()))
        self.failures = failures

    def __reduce__(self):  # crosses process boundaries from tensor-parallel ranks
        return RequestsFailed, (self.failures,)


class RunnerUnavailable(RuntimeError):
    """Raised by a model runner that can run no step any more (a tensor-parallel rank died or hung): the
    step is not retried request by request, it fails whole."""


@dataclass(slots=True)
class IsolatedStep:
    """The part of a step that ran (`sched`, in batch order, and its `output`) and the requests that
    failed, each with its error message."""

    sched: SchedulerOutput
    output: SampleOutput
    failed: dict[Request, str] = field(default_factory=dict)

    def without(self, drop: set[Request]) -> IsolatedStep:
        """The same step with the requests in `drop` (and their sampled tokens) taken out."""
        kept = SchedulerOutput(preempted=self.sched.preempted)
        tokens, logprobs = [], []
        rows = iter(zip(self.output.token_ids, self.output.logprobs))
        sampling = set(self.sched.sample_rows())
        for i, (req, n) in enumerate(zip(self.sched.requests, self.sched.num_new_tokens)):
            row = next(rows) if i in sampling else None
            if req in drop:
                continue
            kept.requests.append(req)
            kept.num_new_tokens.append(n)
            if row is not None:
                tokens.append(row[0])
                logprobs.append(row[1])
        dropped = {r.request_id for r in drop}
        prompt_lps = {rid: c for rid, c in self.output.prompt_logprobs.items() if rid not in dropped}
        accepted = {rid: a for rid, a in self.output.accepted.items() if rid not in dropped}
        return IsolatedStep(kept, SampleOutput(tokens, logprobs, prompt_lps, accepted=accepted), self.failed)


def _subset(sched: SchedulerOutput, requests: list[Request]) -> SchedulerOutput:
    keep = set(requests)
    pairs = [(r, n) for r, n in zip(sched.requests, sched.num_new_tokens) if r in keep]
    return SchedulerOutput([r for r, _ in pairs], [n for _, n in pairs], sched.preempted)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def execute_isolating(execute: Callable[[SchedulerOutput], SampleOutput], sched: SchedulerOutput) -> IsolatedStep:
    """`execute(sched)`; if it raises, the step without the requests that made it fail (see the module
    docstring). Raises only `RunnerUnavailable` from `execute`: when every request fails, all are in `failed`."""
    try:
        return IsolatedStep(sched, execute(sched))
    except RunnerUnavailable:
        raise
    except RequestsFailed as e:
        named = {r: e.failures[r.request_id] for r in sched.requests if r.request_id in e.failures}
        if not named:
            return _bisect(execute, sched, e)
        logger.warning("requests failed while preparing a step: %s", e)
        rest = _subset(sched, [r for r in sched.requests if r not in named])
        step = execute_isolating(execute, rest) if rest.requests else IsolatedStep(rest, SampleOutput([], []))
        step.failed.update(named)
        return step
    except Exception as e:
        return _bisect(execute, sched, e)


def _bisect(execute: Callable[[SchedulerOutput], SampleOutput], sched: SchedulerOutput,
            error: Exception) -> IsolatedStep:
    if len(sched.requests) == 1:
        logger.warning("request %s fails its step on its own", sched.requests[0].request_id, exc_info=error)
        return IsolatedStep(_subset(sched, []), SampleOutput([], []), {sched.requests[0]: _describe(error)})
    mid = len(sched.requests) // 2
    first = execute_isolating(execute, _subset(sched, sched.requests[:mid]))
    second = execute_isolating(execute, _subset(sched, sched.requests[mid:]))
    merged = SchedulerOutput(first.sched.requests + second.sched.requests,
                             first.sched.num_new_tokens + second.sched.num_new_tokens, sched.preempted)
    output = SampleOutput(first.output.token_ids + second.output.token_ids,
                          first.output.logprobs + second.output.logprobs,
                          first.output.prompt_logprobs | second.output.prompt_logprobs,
                          accepted=first.output.accepted | second.output.accepted)
    return IsolatedStep(merged, output, first.failed | second.failed)
