"""vLLM's sampling options through the engine: penalties, logit bias and bad words replayed step by step
against transformers on a tiny random model; special tokens and stop strings in the text; and prompt
logprobs against transformers' own logits for the default model, across prefill chunks and despite a
warm prefix cache."""

from __future__ import annotations

import pytest
import torch

from serving import LLM, SamplingParams

PROMPT = "The robot paints a picture of the sea while the"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="32MiB", max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _expected_token(hf, ids: list[int], n_prompt: int, p: SamplingParams, bad: list[list[int]]) -> int:
    """The greedy pick after vLLM's adjustments, written out per token."""
    with torch.no_grad():
        x = hf(torch.tensor([ids])).logits[0, -1].float()
    out = ids[n_prompt:]
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for word in bad:
        if out[len(out) - len(word) + 1:] == word[:-1] and len(out) >= len(word) - 1:
            x[word[-1]] = float("-inf")
    return int(x.argmax())


@pytest.mark.parametrize("options", [
    {"repetition_penalty": 1.3, "logit_bias": {8085: 6.0, 19063: 6.0, 905: 5.0}},
    {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {8085: 4.0, 19063: 4.0}},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5, "bad_words": [" robot paints"],
     "logit_bias": {8085: 8.0, 19063: 8.5}},
], ids=["repetition", "frequency-presence", "bad-words"])
def test_greedy_with_adjustments_matches_reference(tiny, tiny_hf, options):
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **options)
    out = tiny.generate(PROMPT, p)[0]
    prompt, tokens = out.prompt_token_ids, out.outputs[0].token_ids
    bad = [[8085, 19063]] if "bad_words" in options else []
    for i, token in enumerate(tokens):
        assert token == _expected_token(tiny_hf, prompt + tokens[:i], len(prompt), p, bad), f"token {i}"
    if bad:
        assert 8085 in tokens and not any(a == 8085 and b == 19063 for a, b in zip(tokens, tokens[1:]))


def test_rows_with_and_without_options_share_a_batch(tiny):
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = tiny.generate(PROMPT, plain)[0].outputs[0].token_ids
    forced = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias={4301: 100.0})
    mixed = tiny.generate([PROMPT, PROMPT], [plain, forced])
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].token_ids == [4301] * 8


def test_min_p_keeps_only_likely_tokens(tiny):
    p = SamplingParams(max_tokens=6, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert tiny.generate(PROMPT, p)[0].outputs[0].token_ids == tiny.generate(PROMPT, greedy)[0].outputs[0].token_ids


def test_special_tokens_and_stop_strings_in_text(tiny, tokenizer):
    forced = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {1: 100.0}}
    kept = tiny.generate(PROMPT, SamplingParams(skip_special_tokens=False, **forced))[0].outputs[0]
    skipped = tiny.generate(PROMPT, SamplingParams(**forced))[0].outputs[0]
    assert kept.text == "<|im_start|>" * 3 and skipped.text == ""
    nospace = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False, **forced)
    assert tiny.generate(PROMPT, nospace)[0].outputs[0].text == "<|im_start|>" * 3
    text = tiny.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    stop = text[3:6]
    cut = tiny.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, stop=stop))[0].outputs[0]
    kept = tiny.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, stop=stop,
                                                include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut.text + stop and kept.text.endswith(stop) and kept.finish_reason == "stop"


def test_engine_refuses_ids_outside_the_vocabulary(tiny):
    with pytest.raises(ValueError, match="logit_bias"):
        tiny.generate(PROMPT, SamplingParams(logit_bias={10**6: 1.0}))


@pytest.fixture(scope="module")
def prompt_ids(make_prompts):
    return make_prompts([70], seed=11)[0]


def test_prompt_logprobs_match_transformers(default_model_dir, hf_model, prompt_ids):
    llm = LLM(default_model_dir, dtype="float32", max_model_len=512, kv_cache_memory="64MiB", max_num_batched_tokens=32)
    warm = llm.generate(prompt_ids, SamplingParams(max_tokens=1, temperature=0))[0]
    p = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, n=2)
    out = llm.generate(prompt_ids, p)[0]
    assert warm.prompt_logprobs is None and out.num_cached_tokens == 0
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt_ids) and lps[0] is None
    for pos in range(1, len(prompt_ids)):
        entry, row, token = lps[pos], ref[pos - 1], prompt_ids[pos]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-3)
        assert abs(entry[token].rank - (int((row > row[token]).sum()) + 1)) <= 1
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert [lp.logprob for lp in top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-3)
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-3)
    again = llm.generate(prompt_ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert [list(e) for e in again.prompt_logprobs[1:]] == [[t] for t in prompt_ids[1:]]
    assert [e[t].logprob for e, t in zip(again.prompt_logprobs[1:], prompt_ids[1:])] == pytest.approx(
        [e[t].logprob for e, t in zip(lps[1:], prompt_ids[1:])], abs=1e-5)
