"""Benchmark workload generators (burst, poisson, long-prompt, random, single) as pure functions.

Prompts are slices of the tokenized corpus; all randomness comes from seeded
``numpy.random.default_rng`` generators, drawn in the documented order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from typing import Any

import numpy as np

BURST_NUM_REQUESTS = 256
BURST_PROMPT_LEN = 128
BURST_CAPS = (16, 64, 256)
MEAN_OUTPUT_LEN = 64.0
POISSON_OUTPUT_CAP = 384
LONG_PROMPT_QPS = 4.0
LONG_PROMPT_NUM_REQUESTS = 200
OFFSET_STRIDE = 997
SINGLE_LEN = 128
SINGLE_NUM_REQUESTS = 5


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: prompt token ids, forced output length, arrival (s), and its sampling options
    under their OpenAI names (none: greedy)."""

    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0
    sampling: dict[str, float] = field(default_factory=dict)

    def sampling_options(self) -> dict[str, float]:
        """What the request sends besides its prompt and length: greedy unless `sampling` says otherwise."""
        return {"temperature": 0.0, **self.sampling}


def with_sampling(requests: list[BenchRequest], sampling: dict[str, float]) -> list[BenchRequest]:
    """`requests` with `sampling` (e.g. ``{"temperature": 0.7, "top_p": 0.9}``) on each; unchanged when empty."""
    return [replace(r, sampling=dict(sampling)) for r in requests] if sampling else list(requests)


@lru_cache(maxsize=1)
def load_corpus() -> str:
    """Return the text of ``loadtest/data/corpus.txt`` (located via the package)."""
    return resources.files("loadtest").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def corpus_tokens(tokenizer: Any) -> list[int]:
    """Tokenize the whole corpus once, without special tokens."""
    return list(tokenizer(load_corpus(), add_special_tokens=False).input_ids)


def prompt_slice(tokens: list[int], index: int, length: int) -> list[int]:
    """Prompt of request ``index``: ``tokens[o:o+length]``, ``o = index*997 % (len-length)``."""
    if len(tokens) <= length:
        raise ValueError(f"corpus has {len(tokens)} tokens, need more than {length}")
    offset = (index * OFFSET_STRIDE) % (len(tokens) - length)
    return tokens[offset : offset + length]


def _exp_len(rng: np.random.Generator) -> int:
    """One output length: ``ceil(rng.exponential(64))``."""
    return math.ceil(rng.exponential(MEAN_OUTPUT_LEN))


def burst_output_lens(cap: int, num_requests: int = BURST_NUM_REQUESTS, seed: int = 0) -> list[int]:
    """Rejection-sample ``ceil(exp(64))`` lengths, keeping values <= cap."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while len(lens) < num_requests:
        x = _exp_len(rng)
        if x <= cap:
            lens.append(x)
    return lens


def burst_requests(tokenizer: Any, cap: int) -> list[BenchRequest]:
    """``burst``: 256 requests of 128 prompt tokens, all arriving at t=0."""
    tokens = corpus_tokens(tokenizer)
    return [
        BenchRequest(prompt_slice(tokens, i, BURST_PROMPT_LEN), n, 0.0)
        for i, n in enumerate(burst_output_lens(cap))
    ]


def arrival_times(qps: float, num_requests: int, seed: int) -> list[float]:
    """Cumulative sums of ``rng.exponential(1/qps)`` gaps (first arrival = first gap)."""
    rng = np.random.default_rng(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        t += float(rng.exponential(1.0 / qps))
        times.append(t)
    return times


def poisson_requests(tokenizer: Any, qps: float, num_requests: int = 100) -> list[BenchRequest]:
    """``poisson``: prompt ``integers(1,129)`` then output ``min(ceil(exp(64)),384)`` (seed 1)."""
    tokens = corpus_tokens(tokenizer)
    rng = np.random.default_rng(1)
    times = arrival_times(qps, num_requests, seed=2)
    reqs = []
    for i in range(num_requests):
        prompt_len = int(rng.integers(1, 129))
        output_len = min(_exp_len(rng), POISSON_OUTPUT_CAP)
        reqs.append(BenchRequest(prompt_slice(tokens, i, prompt_len), output_len, times[i]))
    return reqs


def long_prompt_requests(tokenizer: Any) -> list[BenchRequest]:
    """``long-prompt``: 200 requests at 4 QPS; ~10% are 2048/16, the rest 64/64."""
    tokens = corpus_tokens(tokenizer)
    times = arrival_times(LONG_PROMPT_QPS, LONG_PROMPT_NUM_REQUESTS, seed=3)
    rng = np.random.default_rng(4)
    reqs = []
    for i in range(LONG_PROMPT_NUM_REQUESTS):
        prompt_len, output_len = (2048, 16) if rng.random() < 0.1 else (64, 64)
        reqs.append(BenchRequest(prompt_slice(tokens, i, prompt_len), output_len, times[i]))
    return reqs


def random_requests(tokenizer: Any, num: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    """Prompts of uniform random length in [L(1-r), L(1+r)] cut from the corpus, likewise for outputs."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    rng = np.random.default_rng(seed)
    tokens = corpus_tokens(tokenizer)

    def draw(n: int) -> int:
        return int(rng.integers(max(1, math.floor(n * (1 - range_ratio))), math.ceil(n * (1 + range_ratio)) + 1))

    out = []
    for i in range(num):
        p, o = draw(input_len), draw(output_len)
        out.append(BenchRequest(prompt_slice(tokens, i, p), o, 0.0))
    return out


def single_requests(tokenizer: Any, num: int = SINGLE_NUM_REQUESTS, input_len: int = SINGLE_LEN,
                    output_len: int = SINGLE_LEN) -> list[BenchRequest]:
    """``single``: ``num`` requests of ``input_len`` prompt tokens and ``output_len`` output tokens, to run one at
    a time (distinct corpus slices, so no request hits another's prefix cache)."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-requests, --input-len and --output-len must be >= 1")
    tokens = corpus_tokens(tokenizer)
    return [BenchRequest(prompt_slice(tokens, i, input_len), output_len, 0.0) for i in range(num)]
