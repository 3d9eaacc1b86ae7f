"""Running a batch of prompts to the end on an engine, for tests that compare two engines' outputs."""

from __future__ import annotations

from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.sampling_params import SamplingParams


def greedy_outputs(engine: Engine, prompts: list[list[int]], lengths: int) -> dict[str, tuple[list[int], list]]:
    """Prompt i greedily to 2 + i % `lengths` tokens, all as one batch: by request id (`r{i}`) its token ids
    and the top-3 logprobs of each. Checks that every KV block came back."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=2 + i % lengths, temperature=0, ignore_eos=True, logprobs=3)
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt, output_kind=OutputKind.FINAL_ONLY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            done[out.request_id] = (c.token_ids, [{k: v.logprob for k, v in lp.items()} for lp in c.logprobs])
    assert engine.get_stats().kv_cache_usage == 0
    return done
