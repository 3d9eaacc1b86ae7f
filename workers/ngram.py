"""Draft tokens by n-gram prompt lookup (vLLM's speculative method "ngram"): find the most recent earlier
place where the sequence's last n tokens occurred (n from `max_n` down to `min_n`) and propose the tokens
that followed it. The engine then computes the last token and the drafts in one step and keeps the drafts
the model agrees with, plus the model's own next token (`workers/scheduler.py`)."""

from __future__ import annotations

import numpy as np

from workers.sampler import SampleOutput


def propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    `max_n`..`min_n` tokens; [] when no such suffix occurred before."""
    total = len(tokens)
    if k < 1 or total <= min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
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
