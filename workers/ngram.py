"""Draft tokens by n-gram prompt lookup (vLLM's speculative method "ngram"): find the most recent earlier
place where the sequence's last n tokens occurred (n from `max_n` down to `min_n`) and propose the tokens
that followed it. The engine then computes the last token and the drafts in one step and keeps the drafts
the model agrees with, plus the model's own next token (`workers/scheduler.py`)."""

from __future__ import annotations

import numpy as np

from workers.sampler import SampleOutput


class TokenArray:
    """An int64 copy of a token list that only grows at its end (a request's `all_token_ids`), brought up to date
    by the tokens added since it was last read: a request's drafts then cost no conversion of its whole history
    each step (half of `propose`'s time at 1,000 tokens). A list that shrank or another list is copied anew."""

    __slots__ = ("_source", "_buf", "_n")

    def __init__(self) -> None:
        self._source: list[int] | None = None
        self._buf = np.empty(0, dtype=np.int64)
        self._n = 0

    def of(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if tokens is not self._source or n < self._n:
            self._source, self._n = tokens, 0
        if n > len(self._buf):
            buf = np.empty(max(n, 2 * len(self._buf), 256), dtype=np.int64)
            buf[:self._n] = self._buf[:self._n]
            self._buf = buf
        if n > self._n:
            self._buf[self._n:n] = tokens[self._n:n]
            self._n = n
        return self._buf[:n]


def propose(tokens: list[int] | np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    `max_n`..`min_n` tokens; [] when no such suffix occurred before. `tokens`: a list, or its int64 array
    (`TokenArray.of`)."""
    total = len(tokens)
    if k < 1 or total <= min_n:
        return []
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # windows starting at 0..total-n-1 (the suffix itself excluded) that equal the suffix
        hits = arr[:total - n] == arr[total - n]
        for j in range(1, n):
            hits &= arr[j:total - n + j] == arr[total - n + j]
        where = np.flatnonzero(hits)
        if where.size:
            start = int(where[-1]) + n
            return arr[start:start + k].tolist()
    return []


def accept_drafts(output: SampleOutput, row_request_ids: list[str], drafts: list[list[int]]) -> SampleOutput:
    """Fold a speculating step's sampling rows (one per computed token of each sampling request, whose id
    each row names) into one row per request: the model's token after the drafts it agreed with (greedy
    rows: its argmax at each position), and under `accepted` how many drafts that was."""
    tokens, logprobs, accepted = [], [], {}
    row = 0
    for d in drafts:
        rid = row_request_ids[row]
        picked = output.token_ids[row:row + len(d) + 1]
        a = 0
        while a < len(d) and picked[a] == d[a]:
            a += 1
        tokens.append(picked[a])
        logprobs.append(output.logprobs[row + a])
        if d:
            accepted[rid] = a
        row += len(d) + 1
    return SampleOutput(tokens, logprobs, output.prompt_logprobs, output.extra, accepted)
