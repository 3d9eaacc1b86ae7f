"""One scheduled step as plain host tensors and sampling specs: what the model runner needs, with no
`Request` objects, so that the same message runs a local model or goes to every tensor-parallel rank."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.attention import CommonAttentionMetadata
from workers.request import Request
from workers.sampling_params import SamplingParams
from workers.scheduler import SchedulerOutput
from workers.step_isolation import RequestsFailed


@dataclass(slots=True)
class SampleSpec:
    """How one request samples this step: its own seed (if any), its params and the tokens it may not
    pick yet (`min_tokens`)."""

    request_id: str
    seed: int | None
    params: SamplingParams
    ban: list[int] | None


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # [num_samples] rows of the flat batch that sample
    common: CommonAttentionMetadata
    samples: list[SampleSpec]
    released: list[str] = field(default_factory=list)  # finished requests whose generators can go


def build_step_inputs(out: SchedulerOutput, block_size: int, num_heads: int, num_kv_heads: int) -> StepInputs:
    """Flatten every request's new tokens into one unpadded batch with its positions, slot mapping and
    block tables. Raises `RequestsFailed` naming requests whose sampling inputs could not be built."""
    bs = block_size
    reqs = out.requests
    starts = [r.num_computed_tokens for r in reqs]
    input_ids: list[int] = []
    for r, s, n in zip(reqs, starts, out.num_new_tokens):
        input_ids.extend(r.all_token_ids[s:s + n])
    query_lens = torch.tensor(out.num_new_tokens)
    start_t = torch.tensor(starts)
    context_lens = start_t + query_lens
    query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.long)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    positions = torch.arange(len(input_ids)) + torch.repeat_interleave(start_t - query_start_loc[:-1], query_lens)

    width = max(len(r.block_ids) for r in reqs)
    block_tables = torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs])
    req_idx = torch.repeat_interleave(torch.arange(len(reqs)), query_lens)
    slot_mapping = block_tables[req_idx, positions // bs] * bs + positions % bs

    rows = [i for i, (r, s, n) in enumerate(zip(reqs, starts, out.num_new_tokens)) if s + n == r.num_tokens]
    logits_indices = query_start_loc[1:][rows] - 1
    common = CommonAttentionMetadata(query_lens, query_start_loc, context_lens, block_tables, slot_mapping, bs,
                                     num_heads, num_kv_heads)
    return StepInputs(torch.tensor(input_ids), positions, logits_indices, common,
                      _sample_specs([reqs[i] for i in rows]))


def _sample_specs(sampled: list[Request]) -> list[SampleSpec]:
    specs: list[SampleSpec] = []
    failures: dict[str, str] = {}
    for r in sampled:
        try:
            specs.append(SampleSpec(r.request_id, r.seed, r.sampling_params, _min_tokens_ban(r)))
        except Exception as e:
            failures[r.request_id] = f"{type(e).__name__}: {e}"
    if failures:
        raise RequestsFailed(failures)
    return specs


def _min_tokens_ban(req: Request) -> list[int] | None:
    """Tokens that would stop the request before its `min_tokens` are out: EOS and the stop token ids."""
    p = req.sampling_params
    if req.num_output_tokens >= p.min_tokens:
        return None
    eos = [] if p.ignore_eos or req.eos_token_id is None else [req.eos_token_id]
    return eos + p.stop_token_ids or None
