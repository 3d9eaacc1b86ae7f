"""Greedy tokens of one engine against another's on the same prompts: the CPU torch backend against the
device's Triton one in float32, decode graphs on against off, and speculation on against off."""

from __future__ import annotations

from loadtest.gpu_check.engines import generate, greedy, make_engine, random_prompts, release_memory
from loadtest.gpu_check.plan import Plan
from workers.config import EngineConfig


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    pairs = [(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    total = max(sum(map(len, a)), 1)
    same = sum(x == y for x, y in pairs)
    first_diff = [next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), None) for sa, sb in zip(a, b)]
    return {"identical_fraction": same / total, "all_match": a == b, "first_mismatch_per_prompt": first_diff}


def _run(plan: Plan, model: str, dtype: str, device: str, backend: str, graphs: bool, prompts,
         speculative_tokens: int = 0, drafts: dict | None = None, max_num_seqs: int | None = None,
         async_scheduling: bool | None = None, advanced: dict | None = None) -> list[list[int]]:
    engine = make_engine(plan, model, dtype, device, backend, graphs, max_num_seqs=max_num_seqs or max(len(prompts), 8),
                         speculative_tokens=speculative_tokens, async_scheduling=async_scheduling)
    tokens = generate(engine, prompts, greedy(plan.parity_tokens))
    if drafts is not None:  # speculation's drafts computed and kept
        drafts.update(drafts=engine.scheduler.num_draft_tokens, kept=engine.scheduler.num_accepted_tokens)
    if advanced is not None:  # decode steps queued ahead whose inputs the device advanced (`DecodeGraphs.advance`)
        advanced.update(async_scheduling=engine.async_scheduling,
                        steps=engine.runner.graphs.steps_advanced if engine.runner.graphs is not None else 0)
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
    """With graphs the engine's default on a GPU (async scheduling; forced on for the dry run on the CPU) queues
    each decode step behind the one in flight and, the prompts decoding together, advances its inputs on the
    device: those tokens against eager steps built on the host. Passes only if some step was advanced."""
    prompts = random_prompts(plan.parity_prompts, plan.parity_prompt_len, vocab, seed=2)
    advanced: dict = {}
    on = _run(plan, model, dtype, plan.device, "triton", True, prompts,
              async_scheduling=True if plan.dry_run else None, advanced=advanced)
    off = _run(plan, model, dtype, plan.device, "triton", False, prompts)
    result = compare(on, off)
    return {"passed": result["all_match"] and advanced["steps"] > 0, "dtype": dtype, "prompts": len(prompts),
            "tokens_per_prompt": plan.parity_tokens, "async_scheduling": advanced["async_scheduling"],
            "advanced_steps": advanced["steps"], **result}


SPECULATIVE_TOKENS = EngineConfig.num_speculative_tokens  # the serving default


def speculative_vs_plain(plan: Plan, model: str, vocab: int) -> dict:
    """float32 on the device with its graphs: speculation (4 drafts, the serving default) against none. A
    random-weight model repeats itself, so its lookups find drafts; the tokens must not change."""
    prompts = random_prompts(plan.parity_prompts, plan.parity_prompt_len, vocab, seed=3)
    graphs = not plan.dry_run
    # graphs as large as the prompts' steps with their drafts: with CUDA graphs the engine drafts only for as
    # many requests as the largest graph holds with theirs (`default_speculation_limit`), one of 8 at 8 rows
    rows = len(prompts) * (1 + SPECULATIVE_TOKENS)
    plain = _run(plan, model, "float32", plan.device, "triton", graphs, prompts, max_num_seqs=rows)
    drafts: dict = {}
    spec = _run(plan, model, "float32", plan.device, "triton", graphs, prompts, speculative_tokens=SPECULATIVE_TOKENS,
                drafts=drafts, max_num_seqs=rows)
    result = compare(plain, spec)
    # the dry run's three tokens leave no room for a draft; on the device's plan (8 x 24 tokens) this model
    # kept 75 of 78 drafts on the CPU
    kept = drafts["kept"] > 0 or plan.dry_run
    return {"passed": result["all_match"] and kept, "dtype": "float32", "prompts": len(prompts),
            "tokens_per_prompt": plan.parity_tokens, **drafts, **result}
