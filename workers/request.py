"""Request state as the scheduler sees it: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from workers.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    finished: bool  # a plain attribute of each member (read for every request in every step)


for _status in RequestStatus:
    _status.finished = _status.name.startswith("FINISHED_")


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. Prompt and output share `all_token_ids`; nothing distinguishes prefill from decode:
    each step computes tokens from `num_computed_tokens` up to `num_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    eos_token_id: int | None = None
    parent_id: str | None = None
    index: int = 0
    seed: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    predicted_cost: float = 0.0
    fork_source: Request | None = None  # an n>1 sibling whose prompt blocks this request may share
    hold_kv: bool = False  # prefill replica: keep the blocks when the request finishes, until released
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # see workers/penalties.py
    bad_words: object | None = None  # `penalties.BadWords` of those, once a step has banned by them
    spec_token_ids: list[int] = field(default_factory=list)  # this step's draft tokens (speculation), if any
    # Its drafts' record (decayed): drafts kept, and drafts judged (those kept, plus the first refused).
    spec_kept: float = 0.0
    spec_judged: float = 0.0
    spec_skipped: int = 0  # steps since it last drafted for want of a good record
    token_array: object | None = None  # `ngram.TokenArray` of `all_token_ids`, once it has drafted
    may_draft: bool | None = None  # `Scheduler._may_speculate`'s part that never changes, once asked
    # how it samples, once that no longer changes from step to step (`workers/step_inputs.py`)
    sample_spec: object | None = None
    # how it samples in a step queued ahead, once that no longer changes (its bans on the token in flight
    # compared on the device: bad words of one or two tokens)
    ahead_spec: object | None = None
    # what may stop it, set by `Scheduler.add_request` so that a step checks only the tokens that may: the token
    # ids that stop it (EOS unless ignored, `stop_token_ids`; after `min_tokens`), and its length (tokens in all)
    # at which `max_tokens` or `max_model_len` do. 0: every token is checked
    stop_ids: frozenset[int] = frozenset()
    stop_at: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """A request that wants prompt logprobs computes its whole prompt: cached blocks hold no logits."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
