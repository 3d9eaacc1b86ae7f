"""Throughput with decode graphs on and off: a full batch's output tokens per second, its decode-only step
time against the memory roofline (weights plus the KV read once per step, at the measured copy bandwidth),
and one request's decode speed."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from loadtest.gpu_check.engines import (decode_context, generate, greedy, make_engine, random_prompts,
                                        release_memory, sync)
from loadtest.gpu_check.plan import Plan
from workers.engine import Engine
from workers.output_processor import OutputKind


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second of `dst.copy_(src)`, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(engine: Engine) -> int:
    num_layers, _, _, _, kv_heads, head_dim = engine.runner.kv_cache.shape
    return num_layers * 2 * kv_heads * head_dim * engine.runner.kv_cache.element_size()


def weight_bytes(engine: Engine) -> int:
    return sum(p.nbytes for p in engine.model.parameters())


def _timed_run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run every prompt to the end; wall time, and each decode-only step of the full batch with the tokens
    of context it read.

    A step's time is its period, from its `step()` call to the next one's: with async scheduling the device
    runs the step queued ahead while the host is between calls (here, checking the next step's context), so
    the call alone is shorter than a step whenever the device sets the pace, and would overstate the rate.
    The call's own time is kept too (`decode_calls`)."""
    params = greedy(max_tokens)
    for i, ids in enumerate(prompts):
        engine.add_request(f"t{i}", None, params, prompt_token_ids=ids, output_kind=OutputKind.FINAL_ONLY)
    marks: list[tuple[float, int | None]] = []  # each step's start, and its context if decode-only over the batch
    calls: list[float] = []
    outputs = 0
    sync(engine)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        context = decode_context(engine, len(prompts))
        t0 = time.perf_counter()
        marks.append((t0, context))
        for out in engine.step():
            if out.finished:
                outputs += len(out.outputs[0].token_ids)
        if context is not None:
            calls.append(time.perf_counter() - t0)
    sync(engine)
    end = time.perf_counter()
    steps = [(after - t0, context) for (t0, context), (after, _) in zip(marks, marks[1:]) if context is not None]
    return {"wall_s": end - start, "output_tokens": outputs, "decode_steps": steps, "decode_calls": calls}


def _decode_config() -> dict:
    from kernels import triton_attention as ta

    return dataclasses.asdict(ta.DECODE_CONFIG)


def _small_ops_pdl() -> bool:
    """Whether the layers' small kernels launch with programmatic dependent launch (`SMALL_OPS_PDL`)."""
    from kernels import triton_linear

    return triton_linear.SMALL_OPS_PDL


def _norm_linear_config() -> dict | None:
    """The fused norm-and-matmul's config the engine runs with (None: the separate kernels)."""
    from kernels import triton_linear

    config = triton_linear.NORM_LINEAR_CONFIG
    return None if config is None else dataclasses.asdict(config)


def batch_throughput(plan: Plan, model: str, vocab: int, graphs: bool, bandwidth: float,
                     overlap: bool | None = None, ahead: bool | None = None, speculative_tokens: int = 0,
                     speculation_limit: int | None = None) -> dict:
    """`overlap`: make each step's outputs during the next step (`Engine.overlap_outputs`, forced on for the
    dry run on the CPU); False: `disable_async_output_proc`; None: the engine's default, on for a GPU.
    `ahead`: `async_scheduling` (each decode step queued behind the one before; True runs it on the CPU too);
    None: the engine's default, on for a GPU without speculation or with a batch limit to it. `speculative_tokens`:
    drafts per step (the engine's default is 4; 0 here unless given), `speculation_limit`: no drafts while more
    requests run (None: the engine's default, with CUDA graphs the requests whose drafts fit the largest)."""
    engine = make_engine(plan, model, "bfloat16", plan.device, "triton", graphs, max_num_seqs=plan.batch,
                         speculative_tokens=speculative_tokens, in_step_outputs=overlap is False,
                         async_scheduling=ahead, speculation_limit=speculation_limit)
    by_default = engine.overlap_outputs
    if overlap:
        engine.overlap_outputs = True
    # the warm-up is the timed run's shape with a few tokens out: the prefill chunks' kernel variants compile
    # here, not in the first configuration's timed run (the first H100 run's first run compiled 15 and its
    # whole-run rate was half the next ones')
    warm = random_prompts(plan.batch, plan.prompt_len, vocab, seed=9)
    generate(engine, warm, greedy(plan.warmup_tokens), prefix="w")
    sched = engine.scheduler
    drafted = sched.num_draft_tokens, sched.num_accepted_tokens
    graphs = engine.runner.graphs
    advanced = graphs.steps_advanced if graphs is not None else 0
    run = _timed_run(engine, random_prompts(plan.batch, plan.prompt_len, vocab, seed=3), plan.output_len)
    steps, calls = run.pop("decode_steps"), run.pop("decode_calls")
    if speculative_tokens:
        run |= {"draft_tokens": sched.num_draft_tokens - drafted[0],
                "kept_drafts": sched.num_accepted_tokens - drafted[1]}
    result = {"graphs": graphs, "overlap_outputs": engine.overlap_outputs, "overlap_as_configured": by_default,
              "async_scheduling": engine.async_scheduling, "decode_attention_config": _decode_config(),
              "norm_linear_config": _norm_linear_config(), "small_ops_pdl": _small_ops_pdl(),
              "num_speculative_tokens": speculative_tokens,
              "speculative_disable_by_batch_size": sched.config.speculative_disable_by_batch_size,
              "requests": plan.batch, "prompt_len": plan.prompt_len, "output_len": plan.output_len,
              "output_tok_s": run["output_tokens"] / run["wall_s"], **run, "decode_only_steps": len(steps),
              "advanced_steps": graphs.steps_advanced - advanced if graphs is not None else 0}
    if steps:
        step_s = statistics.median(t for t, _ in steps)
        context = statistics.median(c for _, c in steps)
        moved = weight_bytes(engine) + context * kv_bytes_per_token(engine)
        roofline_s = moved / bandwidth
        result |= {"decode_step_ms": step_s * 1e3, "decode_call_ms": statistics.median(calls) * 1e3,
                   "decode_context_tokens": context, "bytes_per_step": moved,
                   "roofline_step_ms": roofline_s * 1e3, "roofline_fraction": roofline_s / step_s}
    if graphs and engine.device.type == "cuda":
        try:  # a measurement on top: its failure must not lose the section's
            result["graph_replay"] = graph_replay(engine, plan.batch, bandwidth)
        except Exception as e:
            result["graph_replay"] = {"error": f"{type(e).__name__}: {e}"}
    del engine
    release_memory()
    return result


def graph_replay(engine: Engine, batch: int, bandwidth: float, repeats: int = 20) -> dict:
    """The device alone: the batch's decode graph replayed back to back over the inputs of the run's last
    decode step (its requests are finished; the replays rewrite their last K/V with the same values), timed
    with CUDA events. Against the step time above, the rest of a step is the host's (scheduling, inputs,
    sampling, detokenizing)."""
    graphs = engine.runner.graphs
    replay, _ = graphs._graphs[batch]
    context = int(graphs._dev.seq_lens[:batch].sum())
    replay()
    torch.cuda.synchronize(engine.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        replay()
    end.record()
    torch.cuda.synchronize(engine.device)
    step_s = start.elapsed_time(end) / 1e3 / repeats
    moved = weight_bytes(engine) + context * kv_bytes_per_token(engine)
    return {"replays": repeats, "context_tokens": context, "device_step_ms": step_s * 1e3, "bytes_per_step": moved,
            "roofline_step_ms": moved / bandwidth * 1e3, "roofline_fraction": moved / bandwidth / step_s}


def batch1_decode(plan: Plan, model: str, vocab: int, graphs: bool) -> dict:
    """One request: decode tokens per second over its decode steps (its prefill excluded)."""
    engine = make_engine(plan, model, "bfloat16", plan.device, "triton", graphs, max_num_seqs=8)
    generate(engine, random_prompts(1, plan.batch1_prompt_len, vocab, seed=8), greedy(plan.warmup_tokens), prefix="w")
    run = _timed_run(engine, random_prompts(1, plan.batch1_prompt_len, vocab, seed=4), plan.batch1_output_len)
    steps = [t for t, _ in run["decode_steps"]]  # periods, as above
    del engine
    release_memory()
    return {"graphs": graphs, "decode_steps": len(steps), "decode_tok_s": len(steps) / sum(steps) if steps else 0.0,
            "median_step_ms": statistics.median(steps) * 1e3 if steps else None}
