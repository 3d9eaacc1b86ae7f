"""Per-request sampling parameters, validated on construction (vLLM's names and meanings).

Every value must be one the engine can hold: integers that reach a tensor or a seeded generator fit
int64, floats are finite, and lists are bounded, so one request's parameters can never break a step
that other requests share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from workers.structured_params import StructuredOutputsParams

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_N = 1024
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 128


def check_int(name: str, value: object, low: int = INT64_MIN, high: int = INT64_MAX) -> None:
    """Raise ValueError naming `name` unless `value` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_range(name: str, value: object, low: float, high: float) -> float:
    """`value` as a float, or ValueError naming `name` unless it is a finite number in [low, high]."""
    x = _check_float(name, value)
    if not low <= x <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")
    return x


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's completion(s).

    `temperature == 0` is greedy. `top_k == -1` (or 0) and `top_p == 1` disable those filters; a
    `top_k` above the vocabulary size keeps the whole vocabulary. `stop` strings are matched on the
    detokenized text and excluded from it; `stop_token_ids` end the completion like EOS (and are kept in
    the token ids, not in the text) unless `include_stop_str_in_output`. Penalties, `min_p`, `logit_bias` and
    `bad_words` have vLLM's meanings (see `workers/penalties.py`); `prompt_logprobs` asks for the top
    log-probabilities at each prompt position. `structured_outputs` constrains the output to a JSON
    schema, a regex, a choice or a grammar (`StructuredOutputsParams`). Fields changed after construction are checked again by `validate()`, which the engine calls on every
    request it takes.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _stop: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (ValueError naming the first bad one) and normalise `stop`, `stop_token_ids`
        and `top_k == 0`."""
        check_int("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1)
        if _check_float("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < _check_float("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer up to {INT64_MAX}, got {self.top_k!r}")
        if self.seed is not None:
            check_int("seed", self.seed)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self._check_logit_adjustments()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._stop = self._check_stop()
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        for token in self.stop_token_ids:
            check_int("each of stop_token_ids", token, 0)
        if self.top_k == 0:
            self.top_k = -1
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    def _check_logit_adjustments(self) -> None:
        """Penalties, min_p, logit_bias, bad_words and prompt_logprobs."""
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(name, getattr(self, name), -2.0, 2.0)
        if _check_float("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
            for token, bias in self.logit_bias.items():
                check_int("each logit_bias token id", token, 0)
                _check_range(f"logit_bias[{token}]", bias, -100.0, 100.0)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words has {len(self.bad_words)} words; at most {MAX_BAD_WORDS} are allowed")
            if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words):
                raise ValueError(f"bad_words must be non-blank strings of at most {MAX_STOP_STRING_CHARS} characters")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must change this row's logits before it picks (penalties or logit_bias)."""
        return self.penalizes or bool(self.logit_bias)

    @property
    def penalizes(self) -> bool:
        """Whether this row's logits depend on its token history (a presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def _check_stop(self) -> list[str]:
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        longest = max(stop, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of "
                             f"{len(longest):,}")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
