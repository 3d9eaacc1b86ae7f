"""One scheduled step as plain host tensors and sampling specs: what the model runner needs, with no
`Request` objects, so that the same message runs a local model or goes to every tensor-parallel rank.
Everything the sampler needs travels with it: params, bans (min_tokens, bad words), token histories for
penalties, the grammar bitmask of constrained rows and the prompt-logprobs plan."""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field

import torch

from kernels.attention import CommonAttentionMetadata
from workers.penalties import BadWords, History
from workers.prompt_logprobs import PromptLogprobsPlan, plan_prompt_logprobs
from workers.request import Request
from workers.sampler import RowBitmask
from workers.sampling_params import SamplingParams
from workers.scheduler import SchedulerOutput
from workers.step_isolation import RequestsFailed


@dataclass(slots=True)
class SampleSpec:
    """How one request samples this step: its own seed (if any), its params, the tokens it may not pick
    now (`min_tokens`, bad words) and its token history (only when it is penalized)."""

    request_id: str
    seed: int | None
    params: SamplingParams
    ban: list[int] | None
    history: History | None = None
    # in a step queued ahead: (token, banned) pairs, `banned` banned only if the token in flight is `token`
    # (a bad word's last token after its next-to-last: `penalties.BadWords.ban_after`)
    ban_after: list[tuple[int, int]] | None = None
    # greedy, unseeded, banning nothing, logits as the model gave them, no logprobs: a batch of such rows
    # samples by argmax alone (`sampler.launch_greedy`)
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain = (p.greedy and self.seed is None and not self.ban and not self.ban_after and self.history is None
                      and not p.adjusts_logits and p.logprobs is None)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # [num_samples] rows of the flat batch that sample
    common: CommonAttentionMetadata
    samples: list[SampleSpec]  # one per sampling row
    drafts: list[list[int]] = field(default_factory=list)  # per sampling request (speculation), if any drafts
    released: list[str] = field(default_factory=list)  # finished requests whose generators can go
    prompt_logprobs: PromptLogprobsPlan | None = None  # extra logits rows that score prompt tokens
    allowed: RowBitmask | None = None  # grammar-constrained rows' allowed tokens (host tensors when sent)


def build_step_inputs(out: SchedulerOutput, block_size: int, num_heads: int, num_kv_heads: int) -> StepInputs:
    """Flatten every request's new tokens into one unpadded batch with its positions, slot mapping and
    block tables. Raises `RequestsFailed` naming requests whose sampling inputs could not be built."""
    reqs = out.requests
    starts = [r.num_computed_tokens for r in reqs]
    nums = out.num_new_tokens
    if out.decodes_only():  # decodes (some with drafts) only
        batch = _decode_rows(reqs, starts, block_size)
    else:
        batch = _flatten(reqs, starts, nums, block_size)
    ends = list(itertools.accumulate(nums))  # where each request's tokens end in the flat batch
    rows = out.sample_rows()
    drafts = [reqs[i].spec_token_ids for i in rows]
    # a speculating request samples at its last token and at each of its drafts
    logits_indices = _long([ends[i] - 1 - len(d) + j for i, d in zip(rows, drafts) for j in range(len(d) + 1)])
    common = CommonAttentionMetadata(batch.query_lens, batch.query_start_loc, batch.context_lens, batch.block_tables,
                                     batch.slot_mapping, block_size, num_heads, num_kv_heads)
    plan = plan_prompt_logprobs(reqs, starts, nums, [e - n for e, n in zip(ends, nums)])
    specs = _sample_specs([reqs[i] for i in rows])
    if any(drafts):
        specs = [s for s, d in zip(specs, drafts) for _ in range(len(d) + 1)]
    else:
        drafts = []
    return StepInputs(batch.input_ids, batch.positions, logits_indices, common, specs, drafts, prompt_logprobs=plan)


@dataclass(slots=True)
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_starts: list[int]  # `query_start_loc` as Python ints


def _long(values: list[int]) -> torch.Tensor:
    """An int64 tensor of `values`, through an `array` (torch.tensor reads a list of ints ~5x slower)."""
    return torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)


def _block_tables(reqs: list[Request]) -> torch.Tensor:
    """Each request's block ids, padded with zeros to the longest: one list extended row by row and read
    into an `array` once (86 us at 256 requests of 12 blocks on a 2-core Zen 4, against 120 us filling a
    zeroed array row by row from an `array` of each, and ~500 us for `torch.tensor` over padded lists)."""
    width = max(len(r.block_ids) for r in reqs)
    zeros = [0] * width
    flat: list[int] = []
    extend = flat.extend
    for r in reqs:
        ids = r.block_ids
        extend(ids)
        extend(zeros[len(ids):])
    return torch.frombuffer(array("q", flat), dtype=torch.long).view(len(reqs), width)


def _flatten(reqs: list[Request], starts: list[int], num_new_tokens: list[int], bs: int) -> _Batch:
    """Any mix of prefill chunks and decodes, in torch ops over the whole batch."""
    input_ids: list[int] = []
    for r, s, n in zip(reqs, starts, num_new_tokens):
        input_ids.extend(r.all_token_ids[s:s + n])
        if r.spec_token_ids:
            input_ids.extend(r.spec_token_ids)
    query_lens = torch.tensor(num_new_tokens)
    start_t = torch.tensor(starts)
    context_lens = start_t + query_lens
    query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.long)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    positions = torch.arange(len(input_ids)) + torch.repeat_interleave(start_t - query_start_loc[:-1], query_lens)
    block_tables = _block_tables(reqs)
    req_idx = torch.repeat_interleave(torch.arange(len(reqs)), query_lens)
    slot_mapping = block_tables[req_idx, positions // bs] * bs + positions % bs
    return _Batch(torch.tensor(input_ids), positions, query_lens, query_start_loc, context_lens, block_tables,
                  slot_mapping, query_start_loc.tolist())


def _decode_rows(reqs: list[Request], starts: list[int], bs: int) -> _Batch:
    """Decodes only, some with drafts: every token its own decode row over its request's blocks, with the
    context up to its own position. A layer writes every row's K/V before any row attends, so a draft sees
    the tokens before it, as in a prefill chunk, and the step runs the decode kernels. Built from Python
    lists: `build_step_inputs` took 107 instead of 292 us a step at one row, 168 instead of 368 at 16, on a
    2-core Zen 5, than through `_flatten` (a one-row step of SmolLM2-135M takes ~8 ms there)."""
    n = len(reqs)
    if not any(r.spec_token_ids for r in reqs):  # one row per request
        return _one_row_each(reqs, _long([r.all_token_ids[s] for r, s in zip(reqs, starts)]), starts, bs)
    ids, positions, owners = [], [], []
    for r, s in zip(reqs, starts):
        ids.append(r.all_token_ids[s])
        positions.append(s)
        owners.append(r)
        for j, t in enumerate(r.spec_token_ids, 1):
            ids.append(t)
            positions.append(s + j)
            owners.append(r)
    n = len(ids)
    return _Batch(_long(ids), _long(positions), torch.ones(n, dtype=torch.long), torch.arange(n + 1),
                  _long([p + 1 for p in positions]), _block_tables(owners),
                  _long([r.block_ids[p // bs] * bs + p % bs for r, p in zip(owners, positions)]), list(range(n + 1)))


def _one_row_each(reqs: list[Request], input_ids: torch.Tensor, starts: list[int], bs: int) -> _Batch:
    """One decode row per request, at position `starts[i]`."""
    n = len(reqs)
    return _Batch(input_ids, _long(starts), torch.ones(n, dtype=torch.long), torch.arange(n + 1),
                  _long([s + 1 for s in starts]), _block_tables(reqs),
                  _long([r.block_ids[s // bs] * bs + s % bs for r, s in zip(reqs, starts)]), list(range(n + 1)))


def build_ahead_inputs(reqs: list[Request], block_size: int, num_heads: int, num_kv_heads: int) -> StepInputs:
    """The decode step after the one in flight (`Engine.async_scheduling`), for requests whose token from it
    is not known yet: each one row at the position after that token, over blocks allocated for it. The
    input ids are placeholders (zeros): the runner takes them from the step in flight's sampled ids, on the
    device. Each request samples with the spec it keeps (`Request.sample_spec`) or, with no bad words, one
    whose `min_tokens` ban counts the token in flight (`ahead_specs`)."""
    starts = [r.num_computed_tokens + 1 for r in reqs]
    batch = _one_row_each(reqs, torch.zeros(len(reqs), dtype=torch.long), starts, block_size)
    common = CommonAttentionMetadata(batch.query_lens, batch.query_start_loc, batch.context_lens, batch.block_tables,
                                     batch.slot_mapping, block_size, num_heads, num_kv_heads)
    return StepInputs(batch.input_ids, batch.positions, torch.arange(len(reqs)), common, ahead_specs(reqs))


def ahead_specs(reqs: list[Request]) -> list[SampleSpec]:
    """The specs of a step queued behind the one in flight: each request's kept one, or one built for the token
    after its token in flight (a request still short of its `min_tokens`, whose ban counts that token; one with
    bad words, whose bans on that token are compared with it on the device)."""
    specs = [r.sample_spec for r in reqs]
    if not all(specs):  # (`None in specs` would call each spec's `__eq__`: 50 us at batch 256)
        specs = _sample_specs(reqs, ahead=1)
    return specs


def sampled_requests(out: SchedulerOutput) -> list[Request]:
    """The request of each of the step's sampling rows (a speculating request has one per token it computes)."""
    return [out.requests[i] for i in out.sample_rows() for _ in range(len(out.requests[i].spec_token_ids) + 1)]


def _sample_specs(sampled: list[Request], ahead: int = 0) -> list[SampleSpec]:
    """One spec per request. A request that bans nothing now nor ever will (its `min_tokens` are out, it has
    no bad words) keeps its spec for the steps after (`Request.sample_spec`); a penalized one's history is its
    own token list, which grows as its tokens are applied. One whose bad words have one or two tokens keeps
    its spec for steps queued ahead (`Request.ahead_spec`: its bans there never change). `ahead`: tokens
    sampled and not yet applied before the one these specs sample (a step queued ahead: 1); a spec is kept
    only once the applied tokens reach `min_tokens`, since the step in flight may yet be run again in turn."""
    specs: list[SampleSpec] = []
    failures: dict[str, str] = {}
    for r in sampled:
        spec = r.sample_spec
        if spec is None and ahead:
            spec = r.ahead_spec
        if spec is not None:
            specs.append(spec)
            continue
        try:
            p = r.sampling_params
            history = (r.all_token_ids, r.num_prompt_tokens) if p.penalizes else None
            ban, after = _bans(r, ahead)
            spec = SampleSpec(r.request_id, r.seed, p, ban, history, after)
            if spec.ban is None and not r.bad_words_token_ids and r.num_output_tokens >= p.min_tokens:
                r.sample_spec = spec
            elif (ahead and r.bad_words_token_ids and r.num_output_tokens + ahead >= p.min_tokens
                  and not r.bad_words.longer):
                r.ahead_spec = spec  # bad words of one or two tokens: the same bans one token ahead from now on
            specs.append(spec)
        except Exception as e:
            failures[r.request_id] = f"{type(e).__name__}: {e}"
    if failures:
        raise RequestsFailed(failures)
    return specs


def _bans(req: Request, ahead: int = 0) -> tuple[list[int] | None, list[tuple[int, int]] | None]:
    """Tokens the request may not pick now (`ahead` tokens after its last applied one, 0 or 1): those that
    would stop it before its `min_tokens` are out (EOS and the stop token ids), and the last tokens of bad
    words the output would complete; then, one token ahead, the bad words' bans that hold only if the token in
    flight is a given one (`SampleSpec.ban_after`)."""
    p = req.sampling_params
    banned = []
    after = None
    if req.num_output_tokens + ahead < p.min_tokens:
        banned = ([] if p.ignore_eos or req.eos_token_id is None else [req.eos_token_id]) + p.stop_token_ids
    if req.bad_words_token_ids:
        words = req.bad_words
        if words is None:
            words = req.bad_words = BadWords(req.bad_words_token_ids)
        if ahead:
            assert ahead == 1, "bad words' bans look one token ahead at most"
            always, after = words.ban_after(req.all_token_ids, len(req.prompt_token_ids))
            banned = banned + always
        else:
            banned += words.ban(req.all_token_ids, len(req.prompt_token_ids))
    return banned or None, after or None
