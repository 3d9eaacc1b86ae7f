"""Admission control of one replica: a request is queued only if at most `max_waiting_requests` sequences
would wait beyond those that can start now; others are shed at once (HTTP 429 with Retry-After) instead
of queueing behind work they would wait long for.

The rule, in sequences (a request with `n` completions is `n` sequences):

    admitted  <=>  W + min(n, max_num_seqs) <= max_waiting_requests + S

    W  sequences waiting: in the scheduler's queue (siblings not yet forked included) as of the engine's
       last step, plus those of requests handed to the engine since, plus requests fetching their KV
    S  sequences that can start now: max(0, max_num_seqs - R), where R is the running sequences, if the
       KV cache has room: P + min(p, C) <= F; else 0
    P  prompt tokens not yet computed (the prefill backlog) as of the last step, plus the prompt tokens
       of requests handed to the engine since; p the request's prompt tokens
    F  free KV cache tokens (free blocks x block size); C the whole cache in tokens

The request's own demand is capped by what an idle replica offers, so an idle replica admits every
request, whatever the limit; `max_waiting_requests = 0` admits exactly what can start now."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

RETRY_AFTER_S = 1  # what a shed client is told to wait (Retry-After, seconds): a step or two frees room


class ShedReason(str, Enum):
    """Why a request was refused: the `reason` label of `kvrelay:num_requests_rejected_total`."""

    QUEUE_FULL = "queue_full"  # no free sequence slot, and the waiting queue is at its limit
    KV_CACHE_FULL = "kv_cache_full"  # a slot is free, but the KV cache has no room for the backlog


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """What admission reads of a replica (see the module docstring for the letters)."""

    num_running: int  # R
    num_waiting: int  # W
    num_pending_tokens: int  # P
    num_free_kv_tokens: int  # F
    kv_capacity_tokens: int  # C


@dataclass(slots=True, frozen=True)
class AdmissionPolicy:
    """`max_waiting_requests=None` admits everything."""

    max_waiting_requests: int | None
    max_num_seqs: int

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 (or None for no limit), got {self.max_waiting_requests}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    def num_startable(self, load: ReplicaLoad, num_prompt_tokens: int) -> int:
        """S: sequences that can start now, given the backlog and this request's prompt."""
        if load.num_pending_tokens + min(num_prompt_tokens, load.kv_capacity_tokens) > load.num_free_kv_tokens:
            return 0
        return max(0, self.max_num_seqs - load.num_running)

    def check(self, load: ReplicaLoad, num_seqs: int, num_prompt_tokens: int) -> ShedReason | None:
        """None to admit the request, else why it is shed."""
        if self.max_waiting_requests is None:
            return None
        demand = load.num_waiting + min(num_seqs, self.max_num_seqs)
        if demand <= self.max_waiting_requests + self.num_startable(load, num_prompt_tokens):
            return None
        free_slots = max(0, self.max_num_seqs - load.num_running)
        if demand <= self.max_waiting_requests + free_slots:
            return ShedReason.KV_CACHE_FULL
        return ShedReason.QUEUE_FULL
