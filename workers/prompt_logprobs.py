"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`): for a request that asks, the logits of
every prompt position computed this step (any chunk) score the next prompt token, with the top-k.

`PromptLogprobsPlan` says which rows of the step's hidden states to turn into logits and what each
scores; `pack` reduces those logits on the device to one flat tensor (it rides the step's single copy
back, see `sample(extra=...)`), and `unpack` turns the host copy into per-request `PromptLogprobsChunk`s."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.request import Request

_ROWS_PER_SLICE = 256  # bounds the float32 log-softmax's memory on long prompt chunks


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Scores of prompt tokens `start + 1 ... start + len(entries)`: per token (logprob, rank, top-k ids,
    top-k logprobs)."""

    start: int
    entries: list[tuple[float, int, list[int], list[float]]]


@dataclass(slots=True)
class PromptLogprobsPlan:
    indices: list[int] = field(default_factory=list)  # flat token rows whose logits are needed
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores
    requests: list[tuple[str, int, int, int]] = field(default_factory=list)  # (id, start position, rows, k)

    @property
    def width(self) -> int:
        return 2 + 2 * max((r[3] for r in self.requests), default=0)

    def pack(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`logits`: [rows, vocab] for `indices`. Returns rows x (logprob, rank, top-k ids, top-k logprobs),
        flattened, float64 (which holds ids and ranks exactly)."""
        k = (self.width - 2) // 2
        parts = []
        for s in range(0, logits.shape[0], _ROWS_PER_SLICE):
            lp = logits[s:s + _ROWS_PER_SLICE].float().log_softmax(-1)
            target = targets[s:s + _ROWS_PER_SLICE, None]
            chosen = lp.gather(1, target)
            ranks = (lp > chosen).sum(-1, keepdim=True) + 1
            top_lp, top_ids = lp.topk(k, dim=-1)
            parts.append(torch.cat([chosen.double(), ranks.double(), top_ids.double(), top_lp.double()], 1))
        return torch.cat(parts).flatten()

    def unpack(self, host: list[float]) -> dict[str, PromptLogprobsChunk]:
        width, k_max = self.width, (self.width - 2) // 2
        out: dict[str, PromptLogprobsChunk] = {}
        row = 0
        for rid, start, n, k in self.requests:
            entries = []
            for r in range(row, row + n):
                v = host[r * width:(r + 1) * width]
                entries.append((v[0], int(v[1]), [int(t) for t in v[2:2 + k]], v[2 + k_max:2 + k_max + k]))
            out[rid] = PromptLogprobsChunk(start, entries)
            row += n
        return out


def plan_prompt_logprobs(requests: list[Request], starts: list[int], num_new_tokens: list[int],
                         query_starts: list[int]) -> PromptLogprobsPlan | None:
    """The rows that score prompt tokens this step (a position scores the token after it, so the last
    prompt position scores none), or None if no scheduled request asks for prompt logprobs."""
    plan = None
    for req, s, n, q in zip(requests, starts, num_new_tokens, query_starts):
        k = req.sampling_params.prompt_logprobs
        if k is None:
            continue
        end = min(s + n, req.num_prompt_tokens - 1)
        if end <= s:
            continue
        plan = plan or PromptLogprobsPlan()
        plan.indices.extend(range(q, q + end - s))
        plan.targets.extend(req.prompt_token_ids[s + 1:end + 1])
        plan.requests.append((req.request_id, s, end - s, k))
    return plan
