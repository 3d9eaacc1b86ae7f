"""Greedy tokens of a few prompts through `LLM.generate`, for tests that compare an engine's device or
attention path with the torch backend's: prompts of 3 to 40 tokens, so a 32-token budget chunks one."""

from __future__ import annotations

from serving import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 17, list(range(300, 303))]


def greedy_tokens(llm: LLM, max_tokens: int = 12) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]
