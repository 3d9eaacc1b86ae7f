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


# places of the last token that `propose` extends in Python; more are first narrowed in numpy to those that match
# more tokens (a numpy call costs ~1 us, more than a few places' Python)
_FEW_CANDIDATES = 32


def propose(tokens: list[int] | np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    `max_n`..`min_n` tokens; [] when no such suffix occurred before. `tokens`: a list, or its int64 array
    (`TokenArray.of`).

    Every occurrence of an n-token suffix ends at an earlier place of the last token and is followed by the
    tokens after that place, whatever n: so the places of the last token are found in one pass over the array,
    narrowed while they are many to those that match more tokens, and each left is extended backwards while it
    matches, up to `max_n` tokens; the longest match wins, the latest among equals. A history whose last token
    did not occur before (most steps of most requests) costs that one pass, not one per n."""
    total = len(tokens)
    if k < 1 or total <= min_n:
        return []
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
    last = total - 1
    ends = (arr[:last] == arr[last]).nonzero()[0]
    if not ends.size:
        return []
    top, n = min(max_n, last), 1  # every place in `ends` matches the last n tokens
    while ends.size > _FEW_CANDIDATES and n < top:  # many: keep those that match one more token, in numpy
        longer = ends[(ends >= n) & (arr[ends - n] == arr[last - n])]  # ends - n < 0 reads the end: masked
        if not longer.size:
            break
        ends, n = longer, n + 1
    if ends.size > _FEW_CANDIDATES or n == top:  # each matches n tokens (none more, or n is the most): the latest
        best, best_len = int(ends[-1]), n
    else:
        at, best, best_len = arr.item, -1, 0
        for p in reversed(ends.tolist()):  # the latest first: the longest match wins, the latest among equals
            m = n
            while m < top and m <= p and at(p - m) == at(last - m):
                m += 1
            if m > best_len:
                best, best_len = p, m
                if m == top:
                    break
    if best_len < min_n:
        return []
    return arr[best + 1:best + 1 + k].tolist()


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
