"""Logit bias, penalties, min_p and bad words on small batched logits, each against a plain per-row
reference; plus the prompt-logprobs packing that rides the sampler's one copy back."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from workers import penalties
from workers.penalties import BadWords, TokenCounts, adjust_logits, apply_min_p, bad_words_token_ids
from workers.prompt_logprobs import PromptLogprobsPlan
from workers.request import Request
from workers.sampler import _mask_banned, sample
from workers.sampling_params import SamplingParams

VOCAB = 40


def _reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    x = row.clone().float()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in range(VOCAB):
        if t in prompt or t in output:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + (p.presence_penalty if c else 0.0)
    return x


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    histories = [([1, 2, 3, 4, 5], 3), ([7, 7, 7, 8], 1), ([9], 1), ([1, 1, 2, 30, 30, 30, 31], 2), ([], 0)]
    params = [SamplingParams(repetition_penalty=1.7),
              SamplingParams(frequency_penalty=0.6, presence_penalty=-0.4, temperature=0),
              SamplingParams(),
              SamplingParams(repetition_penalty=0.5, frequency_penalty=-1.5, presence_penalty=2, logit_bias={0: 5, 30: -100}),
              SamplingParams(logit_bias={3: 2.5, 4: -1})]
    return logits, params, histories


def test_adjustments_match_per_row_reference(batch):
    logits, params, histories = batch
    out = adjust_logits(logits, params, histories)
    for i, (p, (ids, n)) in enumerate(zip(params, histories)):
        torch.testing.assert_close(out[i], _reference(logits[i], p, ids[:n], ids[n:]))
    assert out.data_ptr() != logits.data_ptr()  # the raw logits stay as they were, for logprobs


def test_rows_without_options_cost_nothing(batch):
    logits, _, histories = batch
    plain = [SamplingParams(temperature=0.5, top_k=3)] * 5
    assert adjust_logits(logits, plain, histories) is logits
    assert apply_min_p(logits, [0.0] * 5) is logits


def test_bf16_logits_are_adjusted_in_float32(batch):
    logits, params, histories = batch
    out = adjust_logits(logits.bfloat16(), params, histories)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[3], _reference(logits[3].bfloat16(), params[3], [1, 1], [2, 30, 30, 30, 31]))


def test_counts_kept_between_steps_follow_each_history(batch, monkeypatch):
    """Penalized rows' counts kept in `TokenCounts` across steps: each step as counting the histories anew,
    with only the tokens gained since the step before going to the device; a finished request's row is
    taken by the next one, counted from its own history, and a history that does not extend the one counted
    (a request id used again) is counted anew."""
    logits, params, histories = batch
    ids = ["a", "b", "c", "d", "e"]
    histories = [(list(h), n) for h, n in histories]
    counts = TokenCounts()
    sent: list[int] = []
    copy = penalties.device_tensor
    monkeypatch.setattr(penalties, "device_tensor", lambda v, *a: sent.append(len(v)) or copy(v, *a))
    rng = torch.Generator().manual_seed(1)
    for step in range(6):
        sent.clear()
        out = adjust_logits(logits, params, histories, counts, ids)
        for i, (p, (h, n)) in enumerate(zip(params, histories)):
            torch.testing.assert_close(out[i], _reference(logits[i], p, h[:n], h[n:]))
        if step:  # 3 penalized rows, each its new token's place in the counts and its row, in one copy
            assert max(sent) == 2 * 3
        for h, _ in histories:
            h.append(int(torch.randint(VOCAB, (), generator=rng)))
    assert counts.out.shape[0] == 8 and counts._used == 3
    counts.release(["a"])
    histories[0] = ([2, 2, 9], 1)
    ids[0] = "f"  # takes a's row
    histories[3] = (histories[3][0][:4], 2)  # d again, a shorter history
    out = adjust_logits(logits, params, histories, counts, ids)
    for i in (0, 3):
        h, n = histories[i]
        torch.testing.assert_close(out[i], _reference(logits[i], params[i], h[:n], h[n:]))
    assert counts._used == 3 and counts._rows["f"][0] == 0


@pytest.mark.parametrize("rows", ["all", "some", "out of order"])
def test_a_token_in_flight_counts_as_the_histories_next(batch, rows):
    """A step queued behind the one that samples its rows' last tokens: those tokens come as a device tensor
    (`inflight`, one per row of the batch) and count as if each history ended with its own, whether the kept
    counts are read in place (rows consecutive: the token counted there and taken out again) or gathered
    (`out of order`: the batch's requests in the order opposite to their rows')."""
    logits, params, histories = batch
    if rows != "some":  # every row penalized
        params = [SamplingParams(frequency_penalty=0.5 + 0.1 * i, repetition_penalty=1.3) for i in range(5)]
    nxt = [3, 7, 9, 30, 0]
    ids = list("abcde")
    counts = TokenCounts()
    if rows == "out of order":
        adjust_logits(logits, params, histories, counts, ids)  # rows 0-4, then the batch in reverse
        params, histories, nxt, ids = params[::-1], histories[::-1], nxt[::-1], ids[::-1]
    full = [(h + [t], n) for (h, n), t in zip(histories, nxt)]
    raw = logits.clone()
    for _ in range(2):  # counted anew (or from the rows above), then from the kept counts
        got = adjust_logits(logits, params, histories, counts, ids, inflight=torch.tensor(nxt))
        assert (counts.span is None) == (rows == "out of order")
        torch.testing.assert_close(got, adjust_logits(logits, params, full))
    assert not torch.equal(got, adjust_logits(logits, params, histories))
    assert torch.equal(logits, raw)  # adjusted in a copy, every row or some (the logprobs read the raw ones)


def test_greedy_rows_pick_after_penalties_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=1)
    out = sample(logits, [p], [None], histories=[([0], 1)])
    assert out.token_ids == [1]  # 5 / 2 < 4
    raw = logits.log_softmax(-1)[0]
    chosen_lp, rank, top_ids, top_lps = out.logprobs[0]
    assert chosen_lp == pytest.approx(raw[1].item()) and rank == 2 and top_ids == [0]
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={3: 7.0})], [None]).token_ids == [3]


@pytest.mark.parametrize("seed", range(4))
def test_penalties_gathered_on_the_cpu_give_the_bits_of_the_passes_over_the_logits(seed):
    """The CPU's penalties (the tokens seen gathered, adjusted, put back) against the GPU's in-place passes over
    every logit, run here on the same tensors: equal bit for bit, zeros, infinities and subnormals included,
    over rows with each penalty, all three and none."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 30, 700
    x = torch.randn(rows, vocab, generator=g) * 5
    x[0, :5] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40])
    counts = (torch.rand(rows, vocab, generator=g) < 0.03).float() * torch.randint(1, 6, (rows, vocab), generator=g)
    counts[0, :5] = 2.0
    prompt = torch.rand(rows, vocab, generator=g) < 0.03
    u = torch.rand(rows, 3, generator=g).tolist()
    params = [SamplingParams(frequency_penalty=2 * a - 1 if i % 3 else 0.0, presence_penalty=b if i % 2 else 0.0,
                             repetition_penalty=1 + c if i % 5 else 1.0) for i, (a, b, c) in enumerate(u)]
    for chosen in (params, [dataclasses.replace(p, presence_penalty=0.0, repetition_penalty=1.0) for p in params]):
        gathered, passes = x.clone(), x.clone()
        penalties._apply_penalties(gathered, chosen, counts, prompt, gather=True)
        penalties._apply_penalties(passes, chosen, counts, prompt, gather=False)
        assert torch.equal(gathered.view(torch.int32), passes.view(torch.int32))
        assert not torch.equal(gathered, x)


def test_sampled_rows_draw_from_the_adjusted_logits_and_leave_the_models_alone(batch):
    """Sampled rows draw from their adjusted logits (scaled in place where the sampler made that copy), and
    neither the model's logits nor their raw logprobs change, with adjustments or without."""
    logits, params, histories = batch
    seeded = [dataclasses.replace(p, temperature=0.7, seed=i, logprobs=1) for i, p in enumerate(params)]
    plain = [dataclasses.replace(p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                                 logit_bias=None) for p in seeded]

    def gens():
        return [torch.Generator().manual_seed(i) for i in range(len(seeded))]

    before = logits.clone()
    got = sample(logits, seeded, gens(), histories=histories)
    assert torch.equal(logits, before)
    adjusted = adjust_logits(logits, seeded, histories)
    kept = adjusted.clone()
    want = sample(adjusted, plain, gens())  # no adjustment: the rows scaled in a copy of their own
    assert torch.equal(adjusted, kept)
    assert got.token_ids == want.token_ids
    raw, scaled = logits.log_softmax(-1), adjusted.log_softmax(-1)
    for i, t in enumerate(got.token_ids):
        assert got.logprobs[i][0] == pytest.approx(raw[i, t].item())
        assert want.logprobs[i][0] == pytest.approx(scaled[i, t].item())


def test_min_p_matches_reference_and_sampling_respects_it():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, VOCAB, generator=g) * 2
    min_p = [0.0, 0.3, 0.9]
    out = apply_min_p(x, min_p)
    for i, m in enumerate(min_p):
        probs = x[i].softmax(-1)
        keep = probs >= m * probs.max()
        assert torch.equal(torch.isfinite(out[i]), keep)
        torch.testing.assert_close(out[i][keep], x[i][keep])
    logits = torch.tensor([[3.0, 2.9, -4.0, -5.0]]).repeat(200, 1)
    p = SamplingParams(temperature=1.0, min_p=0.5)
    tokens = sample(logits, [p] * 200, [None] * 200).token_ids
    assert set(tokens) == {0, 1}


def test_bad_words_ban_last_token_after_its_prefix():
    words = [[5], [7, 8], [1, 2, 3]]
    bw = BadWords(words)
    assert bw.ban([], 0) == [5]
    assert bw.ban([9, 7], 0) == [5, 8]
    assert bw.ban([1, 2], 0) == [5, 3]
    assert bw.ban([2, 1], 0) == [5]
    assert bw.ban([7, 1, 2], 1) == [5, 3] and bw.ban([1, 2], 1) == [5]  # the prompt's tokens never make a word


def _reference_ban(output: list[int], words: list[list[int]]) -> list[int]:
    return [w[-1] for w in words
            if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == w[:-1])]


def test_bad_words_bans_against_a_plain_reference_and_after_a_token_in_flight_as_with_it():
    """`BadWords.ban` is the plain rule (a word's last token banned where the output ends with its other
    tokens; prompt tokens never count), and one token ahead, where the host does not know the token in
    flight, what it bans whatever that token is, with the pairs banned where that token is a given one, is
    exactly the ban once the token is known."""
    rng = random.Random(4)
    for _ in range(400):
        words = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 5))]
        prompt = [rng.randrange(6) for _ in range(rng.randint(1, 4))]
        out = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        bw = BadWords(words)
        assert sorted(bw.ban(prompt + out, len(prompt))) == sorted(_reference_ban(out, words))
        always, pairs = bw.ban_after(prompt + out, len(prompt))
        for t in range(6):
            assert sorted(always + [b for want, b in pairs if want == t]) == sorted(_reference_ban(out + [t], words))
    assert BadWords([[5], [7, 8], [1, 2, 3], [9, 4, 6]]).ban_after([9], 0) == ([5], [(7, 8), (4, 6)])


def test_bans_on_the_token_in_flight_hold_only_for_that_token():
    """`_mask_banned`'s pairs ban a row's token where its token in flight is the pair's first; bans for every
    token hold in any case; duplicates and a ban met twice leave -inf; the logits it was given are untouched."""
    logits = torch.arange(24, dtype=torch.float32).view(3, 8)
    inflight = torch.tensor([2, 5, 2])
    out = _mask_banned(logits, [[1], None, None], [[(2, 3), (4, 6)], [(5, 3), (5, 3), (2, 4)], [(7, 0)]], inflight)
    expect = logits.clone()
    expect[0, [1, 3]] = expect[1, 3] = float("-inf")
    assert torch.equal(out, expect) and torch.equal(logits, torch.arange(24, dtype=torch.float32).view(3, 8))
    bf16 = _mask_banned(logits.bfloat16(), [[1, 1], None, [0]], [None, [(5, 7)], None], inflight)
    expect = logits.bfloat16()
    expect[0, 1] = expect[2, 0] = expect[1, 7] = float("-inf")
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, expect)
    with pytest.raises(ValueError, match="in flight"):
        _mask_banned(logits, [None] * 3, [[(2, 3)], None, None])


def test_bad_words_tokenized_with_and_without_leading_space(tokenizer):
    ids = bad_words_token_ids(tokenizer, ["hello", "  world peace"])
    assert tokenizer.encode("hello", add_special_tokens=False) in ids
    assert tokenizer.encode(" hello", add_special_tokens=False) in ids
    assert tokenizer.encode("world peace", add_special_tokens=False) in ids
    assert all(w for w in ids)


def test_sample_brings_extra_back_in_the_same_copy():
    logits = torch.randn(2, VOCAB)
    extra = torch.tensor([1.5, 2.0, 3.0])
    out = sample(logits, [SamplingParams(temperature=0)] * 2, [None] * 2, extra=extra)
    assert out.extra == [1.5, 2.0, 3.0] and out.token_ids == logits.argmax(-1).tolist()
    out = sample(logits, [SamplingParams(temperature=0, logprobs=2)] * 2, [None] * 2, extra=extra)
    assert out.extra == [1.5, 2.0, 3.0] and len(out.logprobs[1][2]) == 2


def test_prompt_logprobs_pack_and_unpack_match_log_softmax():
    from workers.prompt_logprobs import plan_prompt_logprobs

    a = Request("a", [3, 1, 4, 1, 5], SamplingParams(prompt_logprobs=2), 4)
    b = Request("b", [2, 7, 1], SamplingParams(), 4)
    c = Request("c", [9, 2, 6, 5], SamplingParams(prompt_logprobs=0), 4)
    # a computes positions 1..3 (of 0..4), b all, c positions 0..3 (its last scores no prompt token)
    plan = plan_prompt_logprobs([a, b, c], [1, 0, 0], [3, 3, 4], [0, 3, 6])
    assert plan.indices == [0, 1, 2, 6, 7, 8] and plan.targets == [4, 1, 5, 2, 6, 5]
    logits = torch.randn(len(plan.indices), VOCAB)
    host = plan.pack(logits, torch.tensor(plan.targets)).tolist()
    chunks = plan.unpack(host)
    assert set(chunks) == {"a", "c"} and chunks["a"].start == 1 and chunks["c"].start == 0
    lp = logits.log_softmax(-1)
    for row, (lp_row, target) in enumerate(zip(lp, plan.targets)):
        chunk = chunks["a"] if row < 3 else chunks["c"]
        value, rank, top_ids, top_lps = chunk.entries[row if row < 3 else row - 3]
        assert value == pytest.approx(lp_row[target].item(), abs=1e-6)
        assert rank == int((lp_row > lp_row[target]).sum()) + 1
        k = 2 if row < 3 else 0
        assert top_ids == lp_row.topk(k).indices.tolist()
        assert top_lps == pytest.approx(lp_row.topk(k).values.tolist(), abs=1e-6)
    assert plan_prompt_logprobs([b], [0], [3], [0]) is None
    assert isinstance(plan, PromptLogprobsPlan)


def test_before_sync_is_called_once_before_the_copy_back_with_or_without_logprobs():
    logits = torch.randn(2, VOCAB)
    extra = torch.tensor([1.5, 2.0, 3.0])
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2),
                   SamplingParams(temperature=0.8, seed=1)):
        calls = []
        out = sample(logits, [params] * 2, [None] * 2, extra=extra, before_sync=lambda: calls.append(1))
        assert calls == [1] and out.extra == [1.5, 2.0, 3.0] and len(out.token_ids) == 2
