"""Greedy output of the engine equals Hugging Face transformers' `generate`, token for token (float32),
with chunked prefill, under preemption, and independent of batch composition."""

from __future__ import annotations

import pytest

from conftest import hf_greedy
from serving import LLM, SamplingParams

LENGTHS = [5, 17, 40, 100, 150, 255, 400, 600]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(make_prompts):
    return make_prompts(LENGTHS)


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 32},
    {"num_kv_blocks": 64},
], ids=["defaults", "chunked-32", "preempting"])
def test_greedy_matches_transformers(default_model_dir, prompts, reference, options):
    llm = LLM(default_model_dir, dtype="float32", max_model_len=1024, kv_cache_memory="256MiB", **options)
    outs = llm.generate(prompts, GREEDY)
    for out, ref, n in zip(outs, reference, LENGTHS):
        assert out.outputs[0].token_ids == ref, f"prompt of {n} tokens diverged"
        assert out.prompt_token_ids == prompts[LENGTHS.index(n)]
    stats = llm.engine.get_stats()
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def test_batch_invariance(default_model_dir, make_prompts):
    prompts = make_prompts([30 + 20 * i for i in range(16)], seed=5)
    llm = LLM(default_model_dir, dtype="float32", max_model_len=1024, kv_cache_memory="256MiB")
    alone = llm.generate(prompts[3], GREEDY)[0].outputs[0].token_ids
    batched = llm.generate(prompts, GREEDY)
    assert batched[3].outputs[0].token_ids == alone
