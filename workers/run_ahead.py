"""Async scheduling (`Engine.async_scheduling`, vLLM's `--async-scheduling`): which decode steps may be queued on
the device behind the one it runs, before that step's tokens are known, and queuing them.

A step queued ahead has each request of the step in flight that goes on, one row at the position after its
token in flight, over a slot the scheduler allocates for it now (`Scheduler.schedule_ahead`,
`step_inputs.build_ahead_inputs`), its input id read on the device from the step in flight's sampled ids
(`ModelRunner.launch_ahead`). `Engine._step_ahead` collects and applies the steps; this module decides whether
they may run ahead and queues them: whole, or under a grammar their forward pass, their sampling once the step
in front is applied (`RunAhead.sample`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from workers.model_runner import AheadForward, ModelRunner
from workers.sampler import PendingSample
from workers.scheduler import Scheduler, SchedulerOutput
from workers.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    """A decode step queued on the device and not yet applied: its sampling queued (`pending`), or, under a
    grammar, its forward pass only (`forward`), its sampling queued once the step in front is applied
    (`RunAhead.sample`)."""

    sched: SchedulerOutput
    pending: PendingSample | None
    # queued ahead of a step whose requests keep no KV (`may_run_ahead`'s per-request half): true of its own,
    # a subset of those, whose `hold_kv` never changes
    checked: bool = False
    forward: AheadForward | None = None


class RunAhead:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, structured: StructuredOutputManager) -> None:
        self.scheduler, self.runner, self.structured = scheduler, runner, structured
        self.steps_queued = 0  # steps queued behind the one in flight (`run_ahead`)
        self.forwards_queued = 0  # of those, steps whose sampling waited for the step in front (a grammar)

    def launch(self, sched: SchedulerOutput) -> InFlight | None:
        """`sched` queued on the device without waiting, if it is a decode-only step without drafts that may
        be run ahead of (`may_run_ahead`); None otherwise, or if it could not be queued."""
        if not self.scheduler.may_run_ahead() or not all(
                n == 1 and not r.spec_token_ids and r.num_computed_tokens + 1 == len(r.all_token_ids)
                for r, n in zip(sched.requests, sched.num_new_tokens)) or not self.may_run_ahead(sched):
            return None
        try:
            return InFlight(sched, self.runner.launch(sched))
        except Exception:
            logger.debug("step not queued ahead; running it in turn", exc_info=True)
            return None

    def may_run_ahead(self, sched: SchedulerOutput, checked: bool = False) -> bool:
        """Whether the step after `sched` may be queued before `sched`'s tokens are known: no request keeps its
        KV for a transfer (known when `checked`). What the token in flight changes is read on the device: a
        penalized request counts it there (`penalties.TokenCounts`), a bad word's last token is banned where it
        is the word's next-to-last (`SampleSpec.ban_after`); a request short of its `min_tokens` bans by count,
        known on the host (`step_inputs.ahead_specs`). Under a grammar, whose mask needs the token on the
        host, the step's forward pass is queued ahead and its sampling once `sched` is applied (`run_ahead`).
        (Whether it may be scheduled is `Scheduler.schedule_ahead`'s.)"""
        return checked or not any(r.hold_kv for r in sched.requests)

    def run_ahead(self, current: InFlight) -> InFlight | None:
        """The decode step after `current`, queued behind it on the device before its tokens are known
        (`Scheduler.schedule_ahead` picks its requests and their slots). None if it may not run ahead (see
        `Engine._step_ahead`)."""
        ahead = (self.scheduler.schedule_ahead(current.sched) if self.may_run_ahead(current.sched, current.checked)
                 else None)
        if ahead is None:
            return None
        sched, rows = ahead
        defer = self.structured.active  # a grammar's mask needs `current`'s tokens: sample once they are applied
        try:
            queued = self.runner.launch_ahead(sched.requests, current.pending,
                                              None if len(rows) == len(current.sched.requests) else rows, defer)
        except Exception:
            logger.debug("step not queued ahead; running it in turn", exc_info=True)
            return None
        self.steps_queued += 1
        if defer:
            self.forwards_queued += 1
            return InFlight(sched, None, checked=True, forward=queued)
        return InFlight(sched, queued, checked=True)

    def sample(self, inflight: InFlight) -> InFlight | None:
        """A step whose forward pass was queued ahead (`inflight.forward`) with its sampling queued, now that
        the step in front of it is applied (grammars advanced by its tokens); None if it could not be (its
        requests are then scheduled again, as for a step not queued)."""
        try:
            pending = self.runner.sample_ahead(inflight.forward)
        except Exception:
            logger.debug("sampling of a step queued ahead failed; scheduling it again", exc_info=True)
            return None
        return InFlight(inflight.sched, pending, checked=True)
