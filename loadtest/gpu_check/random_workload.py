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

With speculation as the engine serves by default (n-gram drafts for greedy requests while no more run than
the largest graph holds with their drafts, steps queued ahead above that), the same path alternates between
steps that verify drafts in turn and steps queued ahead as requests arrive, end and are preempted: a second
decode path, over a workload of its own (`SPECULATIVE_KINDS`) against its own reference. A random-weight model
with small weights repeats a token for a while, so its lookups find drafts, most kept and some refused.

What must hold: a request that is not aborted gets the same completions (tokens, text, finish and stop
reasons, logprobs within 1e-3); an aborted one gets a prefix of the same tokens, give or take the one step by
which running ahead moves an abort (under preemption the two schedules differ; speculating, a step makes up to
5 tokens, so only the prefix is checked); every block goes back to the pool. Sampled requests keep to the top
20 tokens: a random-weight model spreads its probability thin across its vocabulary, where two paths' float32
rounding (a graph's padded batch, another kernel) moves a draw to the neighbouring token."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from workers.config import EngineConfig, default_speculation_limit
from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.sampling_params import SamplingParams

KINDS = ("greedy", "greedy", "seeded", "logprobs", "penalties", "stop_string", "min_tokens", "n2")
# with speculation: more plain greedy requests (the ones that draft), and none with penalties (which never
# draft; the speculating seeds in the tests were chosen with these kinds)
SPECULATIVE_KINDS = ("greedy", "greedy", "greedy", "greedy", "seeded", "logprobs", "stop_string", "min_tokens", "n2")


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
# with speculation: longer outputs (a greedy request drafts once it repeats itself) in a pool a third larger
# (steps are queued ahead only while no request waits, and preempted ones wait)
CPU_SPECULATIVE_SHAPE = dataclasses.replace(CPU_SHAPE, num_kv_blocks=48, max_tokens=30)
GPU_SPECULATIVE_SHAPE = dataclasses.replace(GPU_SHAPE, num_kv_blocks=48)


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrive: int  # the step before which it is added
    abort: int | None  # the step before which it is aborted, or never
    priority: int = 0  # under the priority policy (lower first)


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
                              frequency_penalty=0.4, ignore_eos=True)
    if kind == "stop_string":
        return SamplingParams(max_tokens=n, temperature=0, stop=[rng.choice(["a", "e", "in", "t"])], ignore_eos=True)
    if kind == "min_tokens":  # stop ids, and EOS, held back for the first half
        return SamplingParams(max_tokens=n, min_tokens=n // 2, temperature=0.7, top_k=20, seed=seed,
                              stop_token_ids=rng.sample(range(50, 1000), 60))
    if kind == "n2":
        return SamplingParams(n=2, max_tokens=n, temperature=0.8, top_k=20, seed=seed, ignore_eos=True)
    raise ValueError(f"unknown request kind {kind!r}")


def workload(seed: int, shape: Shape, kinds: tuple[str, ...] = KINDS, priorities: int = 1) -> list[Req]:
    """`shape.requests` requests of `kinds`, each with a priority in `range(priorities)`."""
    rng = random.Random(seed)
    shared = [rng.randrange(50, 1000) for _ in range(shape.shared_prefix)]
    reqs = []
    for i in range(shape.requests):
        prefix = shared[:rng.choice([0, 1, 2, 3]) * shape.shared_prefix // 3]
        prompt = prefix + [rng.randrange(50, 1000) for _ in range(rng.randrange(1, shape.own_tokens + 1))]
        params = _params(rng, rng.choice(kinds), rng.randrange(3, shape.max_tokens + 1))
        arrive = rng.randrange(0, shape.arrive_within)
        abort = arrive + rng.randrange(2, shape.abort_within + 1) if rng.random() < 0.25 else None
        priority = rng.randrange(priorities) if priorities > 1 else 0
        reqs.append(Req(f"r{i}", prompt, params, arrive, abort, priority))
    return reqs


SPECULATIVE_TOKENS = EngineConfig.num_speculative_tokens  # the serving default


def engine_options(shape: Shape, speculative_tokens: int = 0) -> dict:
    return dict(dtype="float32", num_kv_blocks=shape.num_kv_blocks, block_size=shape.block_size,
                max_model_len=shape.max_model_len, max_num_batched_tokens=shape.max_num_batched_tokens,
                num_speculative_tokens=speculative_tokens, enable_prefix_caching=True)


def run(engine: Engine, reqs: list[Req], max_steps: int = 5000) -> tuple[dict[str, list], dict]:
    """Every delta each request reported, in order ((index, token ids, text, finish reason, stop reason,
    logprobs)); and what the run did, the pool's usage after it included (0 when every block went back)."""
    got: dict[str, list] = {}
    waiting = list(reqs)
    step = most_running = 0
    while waiting or engine.has_unfinished_requests():
        for r in [r for r in waiting if r.arrive <= step]:
            engine.add_request(r.rid, None, r.params, prompt_token_ids=r.prompt, output_kind=OutputKind.DELTA,
                               priority=r.priority)
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
           "steps_queued_ahead": engine.steps_queued_ahead,
           "advanced_steps": graphs.steps_advanced if graphs is not None else 0,
           "blocks_advanced": graphs.blocks_advanced if graphs is not None else 0,
           "drafts": engine.scheduler.num_draft_tokens, "drafts_kept": engine.scheduler.num_accepted_tokens,
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


def consistent_abort(a: list | None, b: list | None, slack: int | None = 1) -> bool:
    """The same tokens up to the shorter, each completion at most `slack` tokens apart (None: any)."""
    ca, cb = completions(a), completions(b)
    for i in set(ca) | set(cb):
        x, y = ca.get(i, {}).get("tokens", []), cb.get(i, {}).get("tokens", [])
        n = min(len(x), len(y))
        if x[:n] != y[:n] or (slack is not None and abs(len(x) - len(y)) > slack):
            return False
    return True


def compare(reqs: list[Req], reference: dict[str, list], got: dict[str, list],
            abort_slack: int | None = 1) -> list[dict]:
    """The requests whose outputs differ as they must not: each with its kind of check and both completions
    (`abort_slack`: how many tokens an aborted request's completions may differ by, None for any)."""
    bad = []
    for r in reqs:
        a, b = reference.get(r.rid), got.get(r.rid)
        ok = consistent_abort(a, b, abort_slack) if r.abort is not None else same(a, b)
        if not ok:
            bad.append({"request": r.rid, "aborted": r.abort is not None, "params": repr(r.params),
                        "reference": completions(a), "got": completions(b)})
    return bad


@dataclass(frozen=True)
class Variant:
    """What a decode path runs: its workload's request kinds, shape (on the CPU and on a GPU), scheduling
    policy and number of priorities, and on the CPU its largest graph."""

    kinds: tuple[str, ...]
    cpu_shape: Shape
    gpu_shape: Shape
    cpu_graph: int
    policy: str = "fcfs"
    priorities: int = 1


# the plain path: graphs of up to 8 rows on the CPU (more requests run than that, so eager steps come between
# graph steps). Speculating: up to 24 on the CPU, which sets the default limit (4 requests, with 4 drafts each);
# and priorities, under which the request a later one's block preempts is more often one the same `schedule`
# has already given drafts (first come, first served preempts the latest to arrive, seldom such a one)
VARIANTS = {"decode_path": Variant(KINDS, CPU_SHAPE, GPU_SHAPE, 8),
            "speculating": Variant(SPECULATIVE_KINDS, CPU_SPECULATIVE_SHAPE, GPU_SPECULATIVE_SHAPE, 24,
                                   policy="priority", priorities=3)}


def engine_config(plan, model: str, variant: str, reference: bool = False):
    """The decode path `variant` runs on the plan's device, float32, or its reference: eager steps in turn, no
    speculation (on the CPU the torch backend: Triton's interpreter would take five times as long). The decode
    path: the engine's default on a GPU (graphs, async scheduling), without speculation, or speculating with
    the serving default's drafts and the limit the engine sets from its largest graph
    (`default_speculation_limit`); on the CPU async scheduling forced and that limit given, for the largest
    graph `VARIANTS` names."""
    v = VARIANTS[variant]
    shape = v.cpu_shape if plan.dry_run else v.gpu_shape
    drafts = SPECULATIVE_TOKENS if variant == "speculating" and not reference else 0
    # graphs up to 32 rows on the GPU (the engine's ladder up to `max_num_seqs`)
    config = EngineConfig(model=model, device=plan.device, attention_backend="torch" if plan.dry_run and reference
                          else "triton", enforce_eager=reference, max_num_seqs=32,
                          async_scheduling=False if reference else None, scheduling_policy=v.policy,
                          **engine_options(shape, drafts))
    if plan.dry_run and not reference:
        limit = default_speculation_limit(config, v.cpu_graph)
        config = dataclasses.replace(config, async_scheduling=True, speculative_disable_by_batch_size=limit)
    return config


def check(plan, model: str, seeds: tuple[int, ...] = (1, 2)) -> dict:
    """The GPU check's section: on the plan's device, float32, the Triton backend, the decode path the engine
    takes there by default (graphs, async scheduling), without speculation and with it, each against eager
    steps in turn over each seed's workload. Passes if every request's outputs agree, every block is back in
    the pool, and the runs preempted, advanced steps whose rows took new blocks on the device, and, speculating,
    kept drafts and queued steps ahead. The dry run on the CPU: one seed, the graphs replayed eagerly and async
    forced."""
    from loadtest.gpu_check.engines import release_memory
    from workers.cuda_graphs import eager_capture

    # on the CPU, seed 2: 16 preemptions, 10 steps advanced with 9 blocks; speculating, seed 1: 5 drafts kept,
    # 7 steps queued ahead, 9 preemptions
    dry_seeds = {"decode_path": 2, "speculating": 1}
    runs = []
    for seed in seeds if not plan.dry_run else (None,):
        entry: dict = {"seed": seed}
        for variant, v in VARIANTS.items():
            wseed, shape = (dry_seeds[variant], v.cpu_shape) if plan.dry_run else (seed, v.gpu_shape)
            reqs = workload(wseed, shape, v.kinds, v.priorities)
            results = []
            for reference in (True, False):
                engine = Engine(engine_config(plan, model, variant, reference))
                if not reference and engine.device.type == "cpu":
                    engine.runner.enable_decode_graphs(v.cpu_graph, engine.max_model_len, capture=eager_capture)
                results.append(run(engine, reqs))
                del engine
                release_memory()
            (reference_got, reference_ran), (got, ran) = results
            # speculating, a request makes up to 5 tokens a step: an aborted one may end that much further on
            mismatches = compare(reqs, reference_got, got, abort_slack=None if variant == "speculating" else 1)
            entry[variant] = {"seed": wseed, "shape": dataclasses.asdict(shape), "policy": v.policy,
                              "requests": len(reqs), "aborted": sum(r.abort is not None for r in reqs), **ran,
                              "reference": reference_ran,
                              "mismatches": mismatches[:5], "mismatch_count": len(mismatches)}
        runs.append(entry)
    passed = all(r[v]["mismatch_count"] == 0 and r[v]["kv_usage_after"] == 0
                 and r[v]["reference"]["kv_usage_after"] == 0 for r in runs for v in VARIANTS)
    # the runs together preempted, advanced steps whose rows took new blocks, and, speculating, kept drafts and
    # queued steps ahead (while more requests ran than the limit)
    exercised = (all(r[v]["graphs"] and r[v]["async_scheduling"] for r in runs for v in VARIANTS)
                 and sum(r["decode_path"]["preemptions"] for r in runs) > 0
                 and sum(r["decode_path"]["blocks_advanced"] for r in runs) > 0
                 and sum(r["speculating"]["drafts_kept"] for r in runs) > 0
                 and sum(r["speculating"]["steps_queued_ahead"] for r in runs) > 0)
    return {"passed": passed and exercised, "exercised": exercised, "dtype": "float32", "runs": runs}
