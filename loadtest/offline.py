"""Run a workload through our engine's offline ``LLM.generate`` API."""

from __future__ import annotations

import time
from typing import Any, Sequence

from loadtest.results import RunResult
from loadtest.workloads import BenchRequest


def generate_token_ids(llm: Any, requests: Sequence[BenchRequest], progress: bool = False) -> list[list[int]]:
    """Submit all requests in one ``generate`` call; return generated ids in input order."""
    from serving import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, **r.sampling_options()) for r in requests]
    outputs = llm.generate([list(r.prompt_token_ids) for r in requests], params, use_tqdm=progress)
    if len(outputs) != len(requests):
        raise RuntimeError(f"engine returned {len(outputs)} outputs for {len(requests)} requests")
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    for i, (r, ids) in enumerate(zip(requests, token_ids)):
        if len(ids) != r.output_len:
            raise RuntimeError(f"request {i}: engine generated {len(ids)} tokens, expected {r.output_len}")
    return token_ids


def run_engine(llm: Any, requests: Sequence[BenchRequest], progress: bool = False) -> RunResult:
    """Time one offline ``generate`` over all requests (model load excluded)."""
    generate_token_ids(llm, [BenchRequest(requests[0].prompt_token_ids[:8], 2)])  # untimed warm-up
    t0 = time.perf_counter()
    token_ids = generate_token_ids(llm, requests, progress)
    wall = time.perf_counter() - t0
    useful = sum(len(ids) for ids in token_ids)
    return RunResult(
        system="engine", num_requests=len(requests), wall_s=wall, useful_tokens=useful,
        generated_tokens=useful, token_ids=token_ids,
    )
