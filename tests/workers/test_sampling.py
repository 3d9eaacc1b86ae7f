"""Sampling through the engine: seeds, n > 1 with shared prompt blocks, top-k, stop strings, logprobs."""

from __future__ import annotations

import pytest
import torch

from serving import LLM, SamplingParams
from workers.output_processor import OutputKind
from workers.penalties import apply_min_p
from workers.sampler import _apply_top_k_top_p, sample


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, dtype="float32", max_model_len=1024, kv_cache_memory="128MiB")


PROMPT = "Write a short story about a robot who learns to paint."


def test_same_seed_same_text(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    a = llm.generate(PROMPT, params)[0].outputs[0]
    b = llm.generate([PROMPT, "unrelated filler prompt"], params)[0].outputs[0]
    assert a.token_ids == b.token_ids
    c = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=99))[0].outputs[0]
    assert c.token_ids != a.token_ids


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0]
    top1 = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.5, top_k=1))[0].outputs[0]
    assert top1.token_ids == greedy.token_ids


def test_n2_children_share_prompt_blocks(llm, make_prompts):
    (prompt,) = make_prompts([100], seed=7)
    engine = llm.engine
    before = engine.get_stats().computed_tokens
    engine.add_request("n2", prompt, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5),
                       output_kind=OutputKind.FINAL_ONLY)
    shared_seen = False
    final = None
    while engine.has_unfinished_requests():
        reqs = list(engine.scheduler.running)
        if len(reqs) == 2:
            a, b = reqs
            shared = (100 - 1) // 16
            assert a.block_ids[:shared] == b.block_ids[:shared]
            assert all(engine.kv_cache.pool.ref_cnt[x] == 2 for x in a.block_ids[:shared])
            assert set(a.block_ids[shared:]).isdisjoint(b.block_ids[shared:])
            shared_seen = True
        for out in engine.step():
            final = out
    assert shared_seen
    assert [o.index for o in final.outputs] == [0, 1]
    assert all(len(o.token_ids) == 6 for o in final.outputs)
    computed = engine.get_stats().computed_tokens - before
    assert computed < 2 * 100  # the second child did not recompute the shared blocks
    assert engine.get_stats().kv_cache_usage == 0.0


def test_n2_through_generate(llm):
    out = llm.generate(PROMPT, SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3))[0]
    assert len(out.outputs) == 2 and out.outputs[0].token_ids != out.outputs[1].token_ids


def test_stop_string_ends_output_and_is_excluded(llm, make_prompts):
    (prompt,) = make_prompts([60], seed=2)
    full = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    words = full.text.split()
    assert len(words) > 4
    stop = " " + words[3]
    expected = full.text[: full.text.index(stop)]
    out = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop, "zzzz-never"]))[0].outputs[0]
    assert out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_length(llm, make_prompts):
    (prompt,) = make_prompts([50], seed=4)
    full = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[full.token_ids[4]]))[0]
    first = full.token_ids.index(full.token_ids[4])
    assert out.outputs[0].token_ids == full.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == full.token_ids[4]


def test_logprobs(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in entry.values())
        assert entry[token].logprob == max(lp.logprob for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_sampler_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.7)]
    seen = [set(), set()]
    for seed in range(200):
        out = sample(logits, params, [torch.Generator().manual_seed(seed), None])
        for row, tok in enumerate(out.token_ids):
            seen[row].add(tok)
    assert seen[0] == {2, 3}
    assert seen[1] == {0, 1}  # probabilities .64, .24, .09, .03: the nucleus of 0.7 needs two tokens


def test_min_tokens_masks_stop_tokens_instead_of_emitting_them(llm, make_prompts):
    """Before `min_tokens` are out, the stop tokens cannot be sampled at all (vLLM's behaviour); they
    used to be sampled and then ignored, so a stop token (or EOS) could appear mid-output."""
    (prompt,) = make_prompts([50], seed=4)
    full = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0]
    first = full.token_ids[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3,
                                              stop_token_ids=[first]))[0].outputs[0]
    assert first not in out.token_ids[:3]
    assert out.token_ids[0] != full.token_ids[0]


def test_sampler_bans_tokens_but_reports_raw_logprobs():
    logits = torch.tensor([[0.0, 1.0, 5.0, 3.0], [0.0, 1.0, 5.0, 3.0]])
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=1.0, seed=1, logprobs=1)]
    for _ in range(20):
        out = sample(logits, params, [None, torch.Generator().manual_seed(_)], [[2], [2, 3]])
        assert out.token_ids[0] == 3 and out.token_ids[1] in (0, 1)
    raw = logits[0].log_softmax(-1)
    assert out.logprobs[0][0] == pytest.approx(float(raw[3]))  # the model's logprob, not the masked one
    assert out.logprobs[0][1] == 2  # its rank among all tokens
    none = sample(logits, params[:1] * 2, [None, None], [None, None])
    assert none.token_ids == [2, 2]


def test_greedy_rows_take_the_compiled_argmax_in_bfloat16(tiny_model_dir, monkeypatch):
    """On the CPU in bfloat16 the sampler's greedy rows go through the compiled ops' argmax, which picks the
    tokens `max(dim=-1)` picks."""
    llm = LLM(tiny_model_dir, dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB")
    ops = llm.engine.runner.model.ops
    if ops.name != "cpp":
        pytest.skip("the compiled kernels did not build")
    compiled, calls = ops.argmax, []

    def spy(logits):
        tokens = compiled(logits)
        calls.append(logits.dtype)
        assert torch.equal(tokens, logits.max(dim=-1).indices)
        return tokens

    monkeypatch.setattr(ops, "argmax", spy)
    outs = llm.generate(["a b c", "one two", "x"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert calls and set(calls) == {torch.bfloat16}


def _frequencies(row: torch.Tensor, params: SamplingParams, draws: int = 24000, batch: int = 4000) -> torch.Tensor:
    counts = torch.zeros(row.numel())
    for _ in range(draws // batch):
        out = sample(row.expand(batch, -1).clone(), [params] * batch, [None] * batch)
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=row.numel())
    return counts / draws


def _reference(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row samples from: temperature, min_p, then the full-sort top-k/top-p mask."""
    x = apply_min_p(row.float()[None] / p.temperature, [p.min_p])
    if p.top_k > 0 or p.top_p < 1:
        x = _apply_top_k_top_p(x, torch.tensor([p.top_k]), torch.tensor([p.top_p]))
    return x.softmax(-1)[0]


@pytest.mark.parametrize("candidates", [1024, 8])  # 8: nucleus rows fall back to the full sort
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=40),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=300, top_p=0.8, min_p=0.02),
], ids=["plain", "top_k", "top_p", "all"])
def test_sampled_frequencies_match_the_filtered_distribution(params, candidates, monkeypatch):
    """Draws by the cumulative distribution (over a row's largest logits for top-k/top-p) follow the
    distribution that the full sort's mask leaves, token by token, and never take a masked token."""
    import workers.sampler as sampler

    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", candidates)
    torch.manual_seed(0)
    row = (torch.randn(3000) * 2.5).to(torch.bfloat16)
    want, draws = _reference(row, params), 24000
    got = _frequencies(row, params, draws)
    assert got[want == 0].sum() == 0
    assert torch.all((got - want).abs() <= 5 * (want * (1 - want) / draws).sqrt() + 2 / draws)


def test_seeded_rows_draw_the_same_tokens_whatever_their_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 500)
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.9, top_p=0.8, seed=8),
              SamplingParams(temperature=1.0)]

    def draw(rows):
        gens = [torch.Generator().manual_seed(params[i].seed) if params[i].seed is not None else None for i in rows]
        return sample(logits[rows], [params[i] for i in rows], gens).token_ids

    assert draw([0, 1, 2])[:2] == draw([0, 1]) == [draw([0])[0], draw([1])[0]]


def test_a_batch_of_plain_greedy_rows_samples_by_argmax_alone(llm, monkeypatch):
    """Rows that are greedy, unseeded, ban nothing, keep their logits and want no logprobs are `plain`; a step
    of only such rows samples through `launch_greedy` (no passes over each row's params), with
    `launch_sample`'s tokens; one row that is not plain sends the whole step the general way."""
    from workers import model_runner
    from workers.sampler import launch_greedy, launch_sample
    from workers.step_inputs import SampleSpec

    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    assert SampleSpec("a", None, greedy, None).plain and SampleSpec("a", None, greedy, []).plain
    assert not SampleSpec("a", 7, greedy, None).plain  # seeded
    assert not SampleSpec("a", None, greedy, [3]).plain  # a ban (min_tokens, bad words)
    assert not SampleSpec("a", None, SamplingParams(temperature=0.0, logprobs=1), None).plain
    assert not SampleSpec("a", None, SamplingParams(temperature=0.0, logit_bias={5: 1.0}), None).plain
    assert not SampleSpec("a", None, SamplingParams(temperature=0.7), None).plain
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert launch_greedy(logits).result() == launch_sample(logits, [greedy] * 5, [None] * 5).result()

    paths: list[str] = []
    real_greedy, real_sample = model_runner.launch_greedy, model_runner.launch_sample
    monkeypatch.setattr(model_runner, "launch_greedy", lambda *a, **k: paths.append("greedy") or real_greedy(*a, **k))
    monkeypatch.setattr(model_runner, "launch_sample", lambda *a, **k: paths.append("sample") or real_sample(*a, **k))
    plain = llm.generate([PROMPT, "another prompt"], greedy)
    assert set(paths) == {"greedy"} and len(paths) >= 4
    paths.clear()
    seeded = SamplingParams(max_tokens=4, temperature=0.0, seed=3)
    mixed = llm.generate([PROMPT, "another prompt"], [greedy, seeded])
    assert set(paths) == {"sample"}
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in plain]
