"""Typed messages between the ingress and the engine replicas (all picklable, all small)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.outputs import RequestOutput
from workers.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """One prompt to generate for; `n > 1` completions travel inside `params`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    hold_kv: bool = False  # prefill pool: keep the prompt's KV and publish a transfer ticket
    kv_ticket: Any = None  # decode pool: fetch the prompt's KV with this ticket instead of computing it
    stream: bool = True  # False: the caller wants the whole answer only, so the request has one output, at its end


@dataclass(slots=True)
class Accepted:
    """First message of a generate stream: the replica queued the request and will publish its outputs
    on the subscriber stream it shares with this ingress."""

    replica_id: str


@dataclass(slots=True)
class Rejected:
    """First (and only) message of a generate stream the replica refused, with the HTTP status to answer
    and, for a busy replica, the seconds after which to retry (HTTP Retry-After)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    retry_after: int | None = None


@dataclass(slots=True)
class RequestError:
    """Why the engine ended a request early, with the HTTP status to answer: 400 when the request itself
    is at fault (found as it was added), 500 when the engine is (a step or the model run failed)."""

    message: str
    status: int = 400


@dataclass(slots=True)
class StepBatch:
    """Everything one engine step produced for one subscriber: deltas of its requests, and the requests
    that ended with an error (id -> why)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    errors: dict[str, RequestError] = field(default_factory=dict)
    kv_tickets: dict[str, Any] = field(default_factory=dict)  # request id -> ticket of its held KV


@dataclass(slots=True)
class ModelInfo:
    """What the ingress needs to validate and tokenize before it sends a request."""

    model_path: str
    max_model_len: int
    vocab_size: int
    block_size: int
    dtype: str
