"""Greedy tokens of one engine against another's on the same prompts: the CPU torch backend against the
device's Triton one in float32, and decode graphs on against off."""

from __future__ import annotations

from loadtest.gpu_check.engines import generate, greedy, make_engine, random_prompts, release_memory
from loadtest.gpu_check.plan import Plan


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    pairs = [(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    total = max(sum(map(len, a)), 1)
    same = sum(x == y for x, y in pairs)
    first_diff = [next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), None) for sa, sb in zip(a, b)]
    return {"identical_fraction": same / total, "all_match": a == b, "first_mismatch_per_prompt": first_diff}


def _run(plan: Plan, model: str, dtype: str, device: str, backend: str, graphs: bool, prompts) -> list[list[int]]:
    engine = make_engine(plan, model, dtype, device, backend, graphs, max_num_seqs=max(len(prompts), 8))
    tokens = generate(engine, prompts, greedy(plan.parity_tokens))
    del engine
    release_memory()
    return tokens


def cpu_vs_device(plan: Plan, model: str, vocab: int) -> dict:
    """float32: the torch backend on the CPU against triton on the device (its default graphs setting)."""
    prompts = random_prompts(plan.parity_prompts, plan.parity_prompt_len, vocab, seed=1)
    cpu = _run(plan, model, "float32", "cpu", "torch", False, prompts)
    dev = _run(plan, model, "float32", plan.device, "triton", not plan.dry_run, prompts)
    result = compare(cpu, dev)
    return {"passed": result["all_match"], "dtype": "float32", "prompts": len(prompts),
            "tokens_per_prompt": plan.parity_tokens, **result}


def graphs_on_vs_off(plan: Plan, model: str, vocab: int, dtype: str = "bfloat16") -> dict:
    prompts = random_prompts(plan.parity_prompts, plan.parity_prompt_len, vocab, seed=2)
    on = _run(plan, model, dtype, plan.device, "triton", True, prompts)
    off = _run(plan, model, dtype, plan.device, "triton", False, prompts)
    result = compare(on, off)
    return {"passed": result["all_match"], "dtype": dtype, "prompts": len(prompts),
            "tokens_per_prompt": plan.parity_tokens, **result}
