"""Async scheduling (`Engine.async_scheduling`, vLLM's `--async-scheduling`): which decode steps may be queued on
the device behind the one it runs, before that step's tokens are known, and queuing them.

A step queued ahead has each request of the step in flight that goes on, one row at the position after its
token in flight, over a slot the scheduler allocates for it now (`Scheduler.schedule_ahead`,
`step_inputs.build_ahead_inputs`), its input id read on the device from the step in flight's sampled ids
(`ModelRunner.launch_ahead`). `Engine.step` collects and applies the steps; this module decides whether their
sampling may run ahead and queues them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from workers.model_runner import ModelRunner
from workers.sampler import PendingSample
from workers.scheduler import Scheduler, SchedulerOutput
from workers.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    """A decode step queued on the device and not yet applied."""

    sched: SchedulerOutput
    pending: PendingSample
    # queued ahead of a step whose requests all sample with fixed specs and keep no KV (`may_run_ahead`'s
    # per-request half): true of its own, a subset of those, whose specs and `hold_kv` never change
    checked: bool = False


class RunAhead:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, structured: StructuredOutputManager) -> None:
        self.scheduler, self.runner, self.structured = scheduler, runner, structured
        self.steps_queued = 0  # steps queued behind the one in flight (`run_ahead`)

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
        """Whether the step after `sched` may be sampled before `sched`'s tokens are known: no grammar is
        active, no request has bad words that may ban a token now (their ban reads the token in flight: those
        whose spec is kept, `Request.sample_spec`, ban none; a request short of its `min_tokens` bans by count,
        known on the host, `step_inputs.ahead_specs`; a penalized one counts its token in flight on the device,
        `penalties.TokenCounts`), and none keeps its KV for a transfer (known when `checked`).
        (Whether it may be scheduled is `Scheduler.schedule_ahead`'s.)"""
        return not self.structured.active and (checked or all(
            (r.sample_spec is not None or not r.bad_words_token_ids) and not r.hold_kv for r in sched.requests))

    def run_ahead(self, current: InFlight) -> InFlight | None:
        """The decode step after `current`, queued behind it on the device before its tokens are known
        (`Scheduler.schedule_ahead` picks its requests and their slots). None if it may not run ahead (see
        `Engine.step`)."""
        ahead = (self.scheduler.schedule_ahead(current.sched) if self.may_run_ahead(current.sched, current.checked)
                 else None)
        if ahead is None:
            return None
        sched, rows = ahead
        try:
            pending = self.runner.launch_ahead(sched.requests, current.pending,
                                               None if len(rows) == len(current.sched.requests) else rows)
        except Exception:
            logger.debug("step not queued ahead; running it in turn", exc_info=True)
            return None
        self.steps_queued += 1
        return InFlight(sched, pending, checked=True)
