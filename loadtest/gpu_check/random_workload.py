"""A random workload through the GPU's decode path against the same device's plain path: every feature that
changes which steps run ahead, which advance on the device and which blocks a row holds, at once.

On a GPU a batch decodes through CUDA graphs (`DecodeGraphs`), each step queued behind the one in flight
(async scheduling) and, over the same rows, advanced on the device (`DecodeGraphs.advance`). The workload runs
that path in a KV pool too small for it (preemption and recompute), with prefix caching, requests arriving and
aborted between steps, prefill chunks beside decodes, and every kind of request: greedy, seeded sampling,
logprobs, penalties, `min_tokens` with stop ids, stop strings and `n=2`. The reference runs eagerly and in turn.
On a GPU it is the one place where a buffer the host reuses while a copy from it is still queued would show
(the CPU runs every step as it is queued); on the CPU (`tests/workers/test_gpu_path_randomized.py`, the dry run)
the same bookkeeping runs with the graphs replayed by `eager_capture`.

What must hold: a request that is not aborted gets the same completions (tokens, text, finish and stop
reasons, logprobs within 1e-3); an aborted one gets a prefix of the same tokens, give or take the one step by
which running ahead moves an abort (under preemption the two schedules differ); every block goes back to the
pool. Sampled requests keep to the top 20 tokens: a random-weight model spreads its probability thin across its
vocabulary, where two paths' float32 rounding (a graph's padded batch, another kernel) moves a draw to the
neighbouring token."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.sampling_params import SamplingParams

KINDS = ("greedy", "greedy", "seeded", "logprobs", "penalties", "stop_string", "min_tokens", "n2")


@dataclass(frozen=True)
class Shape:
    """A workload's size, and the engine settings that make its pool too small for it."""

    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    requests: int
    shared_prefix: int  # a prompt begins with 0, 1/3, 2/3 or all of one shared prefix (the prefix cache's hits)
    own_tokens: int  # then 1 to this many tokens of its own
    max_tokens: int  # outputs of 3 to this many tokens
    arrive_within: int  # requests arrive over this many steps
    abort_within: int  # a quarter of them are aborted 2 to this many steps after they arrive


# blocks of 4 tokens, so rows take blocks every few steps, in a pool of 144 tokens for 20 requests of ~30
CPU_SHAPE = Shape(block_size=4, num_kv_blocks=36, max_model_len=64, max_num_batched_tokens=32, requests=20,
                  shared_prefix=8, own_tokens=9, max_tokens=23, arrive_within=8, abort_within=19)
# the engine's blocks of 16, a pool of 576 tokens for 24 requests of ~75 arriving over 16 steps
GPU_SHAPE = Shape(block_size=16, num_kv_blocks=36, max_model_len=256, max_num_batched_tokens=128, requests=24,
                  shared_prefix=48, own_tokens=40, max_tokens=60, arrive_within=16, abort_within=40)


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrive: int  # the step before which it is added
    abort: int | None  # the step before which it is aborted, or never


def _params(rng: random.Random, kind: str, n: int) -> SamplingParams:
    seed = rng.randrange(1000)
    if kind == "greedy":
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    if kind == "seeded":
        return SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, top_k=20, seed=seed, ignore_eos=True)
    if kind == "logprobs":
        return SamplingParams(max_tokens=n, temperature=0, logprobs=2, ignore_eos=True)
    if kind == "penalties":
        return SamplingParams(max_tokens=n, temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                              ignore_eos=True)
    if kind == "stop_string":
        return SamplingParams(max_tokens=n, temperature=0, stop=[rng.choice(["a", "e", "in", "t"])], ignore_eos=True)
    if kind == "min_tokens":  # stop ids, and EOS, held back for the first half
        return SamplingParams(max_tokens=n, min_tokens=n // 2, temperature=0.7, top_k=20, seed=seed,
                              stop_token_ids=rng.sample(range(50, 1000), 60))
    if kind == "n2":
        return SamplingParams(n=2, max_tokens=n, temperature=0.8, top_k=20, seed=seed, ignore_eos=True)
    raise ValueError(f"unknown request kind {kind!r}")


def workload(seed: int, shape: Shape) -> list[Req]:
    rng = random.Random(seed)
    shared = [rng.randrange(50, 1000) for _ in range(shape.shared_prefix)]
    reqs = []
    for i in range(shape.requests):
        prefix = shared[:rng.choice([0, 1, 2, 3]) * shape.shared_prefix // 3]
        prompt = prefix + [rng.randrange(50, 1000) for _ in range(rng.randrange(1, shape.own_tokens + 1))]
        params = _params(rng, rng.choice(KINDS), rng.randrange(3, shape.max_tokens + 1))
        arrive = rng.randrange(0, shape.arrive_within)
        abort = arrive + rng.randrange(2, shape.abort_within + 1) if rng.random() < 0.25 else None
        reqs.append(Req(f"r{i}", prompt, params, arrive, abort))
    return reqs


def engine_options(shape: Shape) -> dict:
    return dict(dtype="float32", num_kv_blocks=shape.num_kv_blocks, block_size=shape.block_size,
                max_model_len=shape.max_model_len, max_num_batched_tokens=shape.max_num_batched_tokens,
                num_speculative_tokens=0, enable_prefix_caching=True)


def run(engine: Engine, reqs: list[Req], max_steps: int = 5000) -> tuple[dict[str, list], dict]:
    """Every delta each request reported, in order ((index, token ids, text, finish reason, stop reason,
    logprobs)); and what the run did, the pool's usage after it included (0 when every block went back)."""
    got: dict[str, list] = {}
    waiting = list(reqs)
    step = most_running = 0
    while waiting or engine.has_unfinished_requests():
        for r in [r for r in waiting if r.arrive <= step]:
            engine.add_request(r.rid, None, r.params, prompt_token_ids=r.prompt, output_kind=OutputKind.DELTA)
            waiting.remove(r)
        engine.abort_request([r.rid for r in reqs if r.abort == step])
        most_running = max(most_running, len(engine.scheduler.running))
        for out in engine.step():
            for c in out.outputs:
                logprobs = None if c.logprobs is None else [sorted((t, lp.logprob) for t, lp in pos.items())
                                                            for pos in c.logprobs]
                got.setdefault(out.request_id, []).append(
                    (c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, logprobs))
        step += 1
        if step > max_steps:
            raise RuntimeError(f"the workload did not end in {max_steps} steps")
    graphs = engine.runner.graphs
    ran = {"steps": step, "preemptions": engine.scheduler.num_preemptions, "most_running": most_running,
           "advanced_steps": graphs.steps_advanced if graphs is not None else 0,
           "blocks_advanced": graphs.blocks_advanced if graphs is not None else 0,
           "async_scheduling": engine.async_scheduling, "graphs": graphs is not None,
           "kv_usage_after": engine.kv_cache.usage}
    return got, ran


def completions(deltas: list | None) -> dict[int, dict]:
    """Each completion's deltas put together: its tokens, text and logprobs, and how it ended."""
    out: dict[int, dict] = {}
    for index, tokens, text, finish, stop, logprobs in deltas or []:
        c = out.setdefault(index, {"tokens": [], "text": "", "logprobs": None, "finish": None, "stop": None})
        c["tokens"] += tokens
        c["text"] += text
        if logprobs is not None:
            c["logprobs"] = (c["logprobs"] or []) + logprobs
        c["finish"], c["stop"] = finish, stop
    return out


def _same_logprobs(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        [t for t, _ in x] == [t for t, _ in y] and all(math.isclose(p, q, abs_tol=1e-3) for (_, p), (_, q) in zip(x, y))
        for x, y in zip(a, b))


def same(a: list | None, b: list | None) -> bool:
    """The same completions: tokens, text, finish and stop reasons, logprobs. (Not delta by delta: under
    preemption the two schedules differ, and a request's deltas may carry its tokens a step later.)"""
    ca, cb = completions(a), completions(b)
    plain = ("tokens", "text", "finish", "stop")
    return bool(ca) and ca.keys() == cb.keys() and all(
        all(ca[i][k] == cb[i][k] for k in plain) and _same_logprobs(ca[i]["logprobs"], cb[i]["logprobs"]) for i in ca)


def consistent_abort(a: list | None, b: list | None) -> bool:
    """The same tokens up to the shorter, each completion at most one token apart."""
    ca, cb = completions(a), completions(b)
    for i in set(ca) | set(cb):
        x, y = ca.get(i, {}).get("tokens", []), cb.get(i, {}).get("tokens", [])
        n = min(len(x), len(y))
        if x[:n] != y[:n] or abs(len(x) - len(y)) > 1:
            return False
    return True


def compare(reqs: list[Req], reference: dict[str, list], got: dict[str, list]) -> list[dict]:
    """The requests whose outputs differ as they must not: each with its kind of check and both completions."""
    bad = []
    for r in reqs:
        a, b = reference.get(r.rid), got.get(r.rid)
        ok = consistent_abort(a, b) if r.abort is not None else same(a, b)
        if not ok:
            bad.append({"request": r.rid, "aborted": r.abort is not None, "params": repr(r.params),
                        "reference": completions(a), "got": completions(b)})
    return bad


def check(plan, model: str, seeds: tuple[int, ...] = (1, 2)) -> dict:
    """The GPU check's section: on the plan's device, float32, the Triton backend, the decode path the engine
    takes there by default (graphs, async scheduling) against eager steps in turn, over each seed's workload.
    Passes if every request's outputs agree, every block is back in the pool, and the runs preempted and
    advanced steps whose rows took new blocks on the device. The dry run on the CPU: one seed, the graphs
    replayed eagerly and async forced, more requests running than the largest graph holds, and the torch
    backend for the reference (Triton's interpreter would take five times as long)."""
    from loadtest.gpu_check.engines import release_memory
    from workers.config import EngineConfig
    from workers.cuda_graphs import eager_capture

    shape = CPU_SHAPE if plan.dry_run else GPU_SHAPE
    seeds = (2,) if plan.dry_run else seeds  # (the CPU's seed 2: 16 preemptions, 10 steps advanced with 9 blocks)
    runs = []
    for seed in seeds:
        reqs = workload(seed, shape)
        results = {}
        for name, fast in (("reference", False), ("decode_path", True)):
            backend = "torch" if plan.dry_run and not fast else "triton"
            ahead = (True if plan.dry_run else None) if fast else False  # None: the engine's default (on)
            # graphs up to 32 rows on the GPU (the engine's ladder up to `max_num_seqs`); on the CPU up to 8, so
            # that steps too large for them run eagerly between graph steps
            config = EngineConfig(model=model, device=plan.device, attention_backend=backend, enforce_eager=not fast,
                                  max_num_seqs=32, async_scheduling=ahead, **engine_options(shape))
            engine = Engine(config)
            if fast and engine.device.type == "cpu":
                engine.runner.enable_decode_graphs(8, engine.max_model_len, capture=eager_capture)
            results[name] = run(engine, reqs)
            del engine
            release_memory()
        (reference, ran_ref), (got, ran) = results["reference"], results["decode_path"]
        mismatches = compare(reqs, reference, got)
        runs.append({"seed": seed, "requests": len(reqs), "aborted": sum(r.abort is not None for r in reqs),
                     "reference": ran_ref, "decode_path": ran, "mismatches": mismatches[:5],
                     "mismatch_count": len(mismatches)})
    passed = all(r["mismatch_count"] == 0 and r["reference"]["kv_usage_after"] == 0
                 and r["decode_path"]["kv_usage_after"] == 0 for r in runs)
    # the runs together preempted, and advanced steps whose rows took new blocks
    exercised = (all(r["decode_path"]["graphs"] and r["decode_path"]["async_scheduling"] for r in runs)
                 and sum(r["decode_path"]["preemptions"] for r in runs) > 0
                 and sum(r["decode_path"]["blocks_advanced"] for r in runs) > 0)
    return {"passed": passed and exercised, "exercised": exercised, "dtype": "float32", "shape": shape.__dict__,
            "runs": runs}
