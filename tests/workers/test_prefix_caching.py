"""A request that shares a long prefix with an earlier one computes only its new tokens."""

from __future__ import annotations

import pytest

from serving import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    # no speculation: the step-by-step count of computed tokens below would include its drafts
    return LLM(default_model_dir, dtype="float32", max_model_len=1024, kv_cache_memory="128MiB",
               num_speculative_tokens=0)


def test_shared_prefix_computes_only_new_tokens(llm, default_model_dir, make_prompts):
    prefix, tail_a, tail_b = make_prompts([200, 10, 12], seed=11)
    first = llm.generate(prefix + tail_a, GREEDY)[0]
    before = llm.engine.get_stats()
    second = llm.generate(prefix + tail_b, GREEDY)[0]
    after = llm.engine.get_stats()

    cached = (200 // 16) * 16  # whole blocks of the shared prefix
    assert second.num_cached_tokens == cached
    assert after.prefix_cache_hits - before.prefix_cache_hits == cached
    assert after.prefix_cache_queries - before.prefix_cache_queries == 212
    generated = len(second.outputs[0].token_ids)
    # the uncached prompt tokens, then one decode per generated token after the first
    assert after.computed_tokens - before.computed_tokens == (212 - cached) + (generated - 1)
    assert first.num_cached_tokens == 0

    plain = LLM(default_model_dir, dtype="float32", max_model_len=1024, kv_cache_memory="64MiB",
                enable_prefix_caching=False)
    assert plain.generate(prefix + tail_b, GREEDY)[0].outputs[0].token_ids == second.outputs[0].token_ids
    assert plain.engine.get_stats().prefix_cache_hits == 0


def test_identical_prompt_reuses_all_but_last_token(llm, make_prompts):
    (prompt,) = make_prompts([64], seed=3)
    a = llm.generate(prompt, GREEDY)[0]
    b = llm.generate(prompt, GREEDY)[0]
    assert b.num_cached_tokens == 48  # the block holding the last prompt token is recomputed
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert llm.engine.get_stats().kv_cache_usage == 0.0
