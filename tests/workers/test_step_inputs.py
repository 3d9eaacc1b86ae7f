"""`build_step_inputs`: a decode-only step's fast path gives the tensors of the general one."""

from __future__ import annotations

import random

import pytest
import torch

from workers import step_inputs
from workers.request import Request
from workers.sampling_params import SamplingParams
from workers.scheduler import SchedulerOutput


def _request(rng: random.Random, i: int, bs: int, computed: int, total: int) -> Request:
    prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, total))]
    r = Request(f"r{i}", prompt, SamplingParams(max_tokens=64), 64)
    r.all_token_ids = prompt + [rng.randrange(3, 1000) for _ in range(total - len(prompt))]
    r.num_computed_tokens = computed
    r.block_ids = rng.sample(range(1, 500), -(-total // bs))
    return r


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("seed", range(4))
def test_decode_rows_equal_the_general_flattening(bs, seed):
    """Decodes at random positions, and prefill chunks of one token that do not reach their last token
    (they do not sample): every tensor, its dtype and the sampled rows are those of the general path."""
    rng = random.Random(seed)
    reqs = []
    for i in range(rng.randint(1, 40)):
        total = rng.randint(1, 200)
        computed = total - 1 if rng.random() < 0.8 else rng.randint(0, total - 1)  # else a 1-token chunk
        reqs.append(_request(rng, i, bs, computed, total))
    out = SchedulerOutput(reqs, [1] * len(reqs))
    starts = [r.num_computed_tokens for r in reqs]
    fast = step_inputs._decode_rows(reqs, starts, bs)
    general = step_inputs._flatten(reqs, starts, out.num_new_tokens, bs)
    for name in step_inputs._Batch.__slots__:
        a, b = getattr(fast, name), getattr(general, name)
        assert a == b if name == "query_starts" else a.dtype == b.dtype and torch.equal(a, b), name

    step = step_inputs.build_step_inputs(out, bs, 9, 3)
    rows = [i for i, r in enumerate(reqs) if r.num_computed_tokens + 1 == r.num_tokens]
    assert torch.equal(step.logits_indices, general.query_start_loc[1:][rows] - 1)
    assert [s.request_id for s in step.samples] == [reqs[i].request_id for i in rows]
    assert torch.equal(step.input_ids, general.input_ids) and torch.equal(step.common.slot_mapping, general.slot_mapping)


@pytest.mark.parametrize("bs", [1, 16])
def test_speculating_requests_run_one_decode_row_per_token(bs):
    """Decodes beside requests with drafts: one row per token, each over its request's blocks up to its own
    position; the tokens, positions and slots of the general path; every token of a speculating request
    samples, in order."""
    rng = random.Random(bs)
    reqs = [_request(rng, i, bs, total - 1, total) for i, total in enumerate([30, 7, 64, 1])]
    reqs[0].spec_token_ids, reqs[2].spec_token_ids = [11, 12, 13], [5]
    for r in reqs:  # the blocks the drafts' positions need
        r.block_ids += rng.sample(range(500, 900), -(-(r.num_tokens + len(r.spec_token_ids)) // bs) - len(r.block_ids))
    out = SchedulerOutput(reqs, [1 + len(r.spec_token_ids) for r in reqs])
    starts = [r.num_computed_tokens for r in reqs]
    rows = step_inputs._decode_rows(reqs, starts, bs)
    general = step_inputs._flatten(reqs, starts, out.num_new_tokens, bs)
    for name in ("input_ids", "positions", "slot_mapping"):
        assert torch.equal(getattr(rows, name), getattr(general, name)), name
    assert torch.equal(rows.context_lens, rows.positions + 1) and rows.query_lens.tolist() == [1] * 8
    owners = [0, 0, 0, 0, 1, 2, 2, 3]
    assert rows.block_tables.tolist() == [general.block_tables[i].tolist() for i in owners]

    step = step_inputs.build_step_inputs(out, bs, 9, 3)
    assert step.logits_indices.tolist() == list(range(8))
    assert [s.request_id for s in step.samples] == [reqs[i].request_id for i in owners]
    assert step.drafts == [[11, 12, 13], [], [5], []]
    assert step.common.query_lens.tolist() == [1] * 8  # decode rows: the attention's decode kernels take them


def test_mixed_steps_take_the_general_path(monkeypatch):
    rng = random.Random(7)
    reqs = [_request(rng, 0, 16, 0, 40), _request(rng, 1, 16, 30, 31)]
    monkeypatch.setattr(step_inputs, "_decode_rows", lambda *a: pytest.fail("a prefill step took the decode path"))
    step = step_inputs.build_step_inputs(SchedulerOutput(reqs, [40, 1]), 16, 9, 3)
    assert step.input_ids.tolist() == reqs[0].all_token_ids + [reqs[1].all_token_ids[30]]
    assert step.positions.tolist() == list(range(40)) + [30]
    assert step.logits_indices.tolist() == [39, 40]


def test_a_step_where_no_request_samples_has_long_empty_logits_indices():
    """One-token prefill chunks that do not reach their prompt's end sample nothing; the rows to sample are
    still a long tensor (an index), empty."""
    rng = random.Random(8)
    reqs = [_request(rng, i, 16, 10, 20) for i in range(2)]
    for r in reqs:
        r.all_token_ids = r.all_token_ids[:20]
    step = step_inputs.build_step_inputs(SchedulerOutput(reqs, [1, 1]), 16, 9, 3)
    assert step.logits_indices.dtype == torch.long and step.logits_indices.numel() == 0 and not step.samples


def test_a_request_keeps_its_sample_spec_once_it_no_longer_changes():
    """A request's spec is rebuilt while it bans tokens (min_tokens not out) and always with bad words (its
    ban may change with every token); otherwise the first one is reused, a penalized one's history being the
    request's own token list, which grows with it."""
    rng = random.Random(9)

    def decoding(params: SamplingParams, **kw) -> Request:
        r = _request(rng, 0, 16, 0, 20)
        r.sampling_params, r.eos_token_id = params, 2
        for k, v in kw.items():
            setattr(r, k, v)
        r.num_computed_tokens = r.num_tokens - 1
        return r

    def spec(r: Request):
        return step_inputs.build_step_inputs(SchedulerOutput([r], [1]), 16, 9, 3).samples[0]

    def grow(r: Request) -> None:
        r.append_token(rng.randrange(3, 1000))
        r.num_computed_tokens += 1

    plain = decoding(SamplingParams(max_tokens=64))
    first = spec(plain)
    assert first.ban is None and first.history is None and spec(plain) is first

    held = decoding(SamplingParams(max_tokens=64, min_tokens=2))
    held.prompt_token_ids = list(held.all_token_ids)  # no output yet
    assert spec(held).ban == [2] and spec(held) is not spec(held)
    grow(held)
    assert spec(held).ban == [2]
    grow(held)
    kept = spec(held)
    assert kept.ban is None and spec(held) is kept

    words = decoding(SamplingParams(max_tokens=64), bad_words_token_ids=[[7]])
    assert spec(words).ban == [7] and spec(words) is not spec(words)
    penalised = decoding(SamplingParams(max_tokens=64, repetition_penalty=1.2))
    s = spec(penalised)
    assert s.history[0] is penalised.all_token_ids and s.history[1] == penalised.num_prompt_tokens
    grow(penalised)
    assert spec(penalised) is s and s.history[0][-1] == penalised.all_token_ids[-1]
    biased = decoding(SamplingParams(max_tokens=64, logit_bias={5: 2.0}))  # no history: the bias is fixed
    b = spec(biased)
    assert b.history is None and spec(biased) is b


def test_a_step_queued_ahead_bans_by_the_count_with_the_token_in_flight():
    """`ahead_specs`: a request short of its `min_tokens` samples, in a step queued ahead, the token after its
    token in flight, so its stop ids are banned while its applied tokens plus one are short; the spec is kept
    only once the applied tokens reach `min_tokens` (the step in flight may run again in turn)."""
    r = Request("m", [5, 6, 7], SamplingParams(max_tokens=16, min_tokens=3, stop_token_ids=[9]), 16)
    r.eos_token_id = 2
    specs = []
    for _ in range(4):
        now = step_inputs._sample_specs([r])[0] if r.sample_spec is None else r.sample_spec
        specs.append((r.num_output_tokens, now.ban, step_inputs.ahead_specs([r])[0].ban, r.sample_spec is not None))
        r.append_token(11)
    assert specs == [(0, [2, 9], [2, 9], False), (1, [2, 9], [2, 9], False), (2, [2, 9], None, False),
                     (3, None, None, True)]
    kept = r.sample_spec
    assert step_inputs.ahead_specs([r])[0] is kept


def test_a_step_queued_ahead_bans_a_bad_words_last_token_where_the_token_in_flight_may_begin_it():
    """`ahead_specs` for a request with bad words: one-token words banned outright, and each longer word whose
    tokens before its last two end the applied output gives a (next-to-last, last) pair (`ban_after`), which
    the device compares with the token in flight; such a spec is never kept and is never plain."""
    r = Request("w", [5, 6, 7], SamplingParams(max_tokens=16), 16)
    r.bad_words_token_ids = [[4], [8, 9], [10, 11, 12]]
    got = []
    for token in (10, 3, 10):
        spec = step_inputs.ahead_specs([r])[0]
        got.append((spec.ban, spec.ban_after, spec.plain))
        r.append_token(token)
    assert got == [([4], [(8, 9)], False), ([4], [(8, 9), (11, 12)], False), ([4], [(8, 9)], False)]
    r.append_token(11)
    assert step_inputs._sample_specs([r])[0].ban == [4, 12] and r.sample_spec is None
    assert step_inputs._sample_specs([r])[0].ban_after is None
    short = Request("s", [5, 6, 7], SamplingParams(max_tokens=16, min_tokens=2), 16)
    short.bad_words_token_ids = [[4], [8, 9]]  # bans one token ahead that never change, once min_tokens allows
    short.eos_token_id = 2
    first = step_inputs.ahead_specs([short])[0]
    assert first.ban == [2, 4] and first.ban_after == [(8, 9)] and short.ahead_spec is None
    short.append_token(3)
    kept = step_inputs.ahead_specs([short])[0]
    assert kept.ban == [4] and kept.ban_after == [(8, 9)] and short.ahead_spec is kept
    short.append_token(8)
    assert step_inputs.ahead_specs([short])[0] is kept and short.sample_spec is None
    assert step_inputs._sample_specs([short])[0].ban == [4, 9]  # in turn: the last token known
