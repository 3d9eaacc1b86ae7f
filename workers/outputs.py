"""What the engine returns: vLLM-shaped request and completion outputs.

Each pickles as its class and its fields in order (`_pickled_by_fields`), not as a slots dataclass's state
(a dict of its slots, built in Python per object, set after): a step's outputs cross processes every step
where the engine has a replica of its own (to each ingress, over Serve). A batch-256 step's delta outputs
pickled in 0.65-0.82 ms and unpickled in 0.49-0.66 that way, 0.34-0.44 and 0.25-0.27 this way, 29% fewer
bytes (2-core Zen 4; docs/results/engine-process-20261206/pickle_bench.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter


def _pickled_by_fields(cls):
    fields = attrgetter(*cls.__slots__)

    def __reduce__(self):
        return cls, fields(self)

    cls.__reduce__ = __reduce__
    return cls


@_pickled_by_fields
@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@_pickled_by_fields
@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@_pickled_by_fields
@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # None, then per prompt token its top-k and actual token (when asked; in delta outputs, the first only)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two delta outputs of one request, `later` right after `first`, as one: each sequence's text, tokens and
    logprobs joined, the later finish reason, cumulative logprob and state; prompt logprobs (in the first
    delta only) kept. Neither input is changed. What a consumer behind the engine sends as one chunk (vLLM's
    output collector merges alike)."""
    seqs = {c.index: c for c in first.outputs}
    for c in later.outputs:
        a = seqs.get(c.index)
        seqs[c.index] = c if a is None else CompletionOutput(
            c.index, a.text + c.text, a.token_ids + c.token_ids,
            c.cumulative_logprob if c.cumulative_logprob is not None else a.cumulative_logprob,
            None if a.logprobs is None and c.logprobs is None else (a.logprobs or []) + (c.logprobs or []),
            c.finish_reason if c.finish_reason is not None else a.finish_reason,
            c.stop_reason if c.stop_reason is not None else a.stop_reason)
    return RequestOutput(later.request_id, later.prompt if later.prompt is not None else first.prompt,
                         later.prompt_token_ids, [seqs[i] for i in sorted(seqs)], later.finished,
                         later.num_cached_tokens, {**first.metrics, **later.metrics},
                         first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs)
