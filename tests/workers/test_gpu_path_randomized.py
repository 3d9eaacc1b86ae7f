"""The GPU's decode path against the plain engine on random workloads: every feature that changes which steps
run ahead, which advance on the device and which blocks a row holds, at once.

On a GPU a batch decodes through CUDA graphs (`DecodeGraphs`), each step queued behind the one in flight
(async scheduling) and, over the same rows, advanced on the device (`DecodeGraphs.advance`). Here that path
runs on the CPU (the Triton backend in its interpreter, the graphs replayed by `eager_capture`) over blocks of
4 tokens in a pool too small for the workload (preemption and recompute), with prefix caching, requests
arriving and aborted between steps, more running than the largest graph holds (eager steps between graph
steps), and every kind of request: greedy, seeded sampling, logprobs, penalties, `min_tokens`, stop tokens,
stop strings and `n=2`. The reference is the torch backend, eager and in turn.

What must hold: a request that is not aborted gets the same completions (tokens, text, finish and stop
reasons, logprobs); an aborted one gets a prefix of the same tokens, give or take the one step by which
running ahead moves an abort (under preemption the two engines' schedules differ); every block goes back to
the pool. Sampled requests keep to the top 20 tokens: the random-weight model spreads its probability thin
across 49,152 tokens, where the two backends' float32 rounding moves a draw to the neighbouring token."""

from __future__ import annotations

import math
import random

import pytest

from workers.cuda_graphs import eager_capture
from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.sampling_params import SamplingParams

pytest.importorskip("triton", reason="triton is not installed")

MAX_GRAPH_BATCH = 8


def _params(rng: random.Random, kind: str, n: int) -> SamplingParams:
    seed = rng.randrange(1000)
    return {
        "greedy": lambda: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
        "seeded": lambda: SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, top_k=20, seed=seed,
                                         ignore_eos=True),
        "logprobs": lambda: SamplingParams(max_tokens=n, temperature=0, logprobs=2, ignore_eos=True),
        "penalties": lambda: SamplingParams(max_tokens=n, temperature=0, repetition_penalty=1.3,
                                            presence_penalty=0.5, ignore_eos=True),
        "stop_string": lambda: SamplingParams(max_tokens=n, temperature=0, stop=[rng.choice(["a", "e", "in", "t"])],
                                              ignore_eos=True),
        # stop ids, and EOS, held back for the first half
        "min_tokens": lambda: SamplingParams(max_tokens=n, min_tokens=n // 2, temperature=0.7, top_k=20, seed=seed,
                                             stop_token_ids=rng.sample(range(50, 1000), 60)),
        "n2": lambda: SamplingParams(n=2, max_tokens=n, temperature=0.8, top_k=20, seed=seed, ignore_eos=True),
    }[kind]()


def _workload(seed: int, count: int = 20) -> list[tuple[str, list[int], SamplingParams, int, int | None]]:
    """(id, prompt, params, arriving at step, aborted that many steps later or never)."""
    rng = random.Random(seed)
    shared = [rng.randrange(50, 1000) for _ in range(12)]  # prefixes for the prefix cache
    kinds = ["greedy", "greedy", "seeded", "logprobs", "penalties", "stop_string", "min_tokens", "n2"]
    reqs = []
    for i in range(count):
        prompt = shared[:rng.choice([0, 4, 8])] + [rng.randrange(50, 1000) for _ in range(rng.randrange(1, 10))]
        params = _params(rng, rng.choice(kinds), rng.randrange(3, 24))
        abort_after = rng.choice([None, None, None, rng.randrange(2, 20)])
        reqs.append((f"r{i}", prompt, params, rng.randrange(0, 8), abort_after))
    return reqs


def _engine(model: str, gpu_path: bool) -> Engine:
    kw = dict(model=model, dtype="float32", num_kv_blocks=36, block_size=4, max_model_len=64,
              max_num_batched_tokens=32, num_speculative_tokens=0, enable_prefix_caching=True)
    if not gpu_path:
        return Engine(attention_backend="torch", **kw)
    engine = Engine(attention_backend="triton", device="cpu", async_scheduling=True, **kw)
    engine.runner.enable_decode_graphs(max_batch=MAX_GRAPH_BATCH, max_model_len=engine.max_model_len,
                                       capture=eager_capture)
    return engine


def _run(engine: Engine, reqs) -> tuple[dict[str, list], dict]:
    """Every delta each request reported, in order; and what the run did."""
    got: dict[str, list] = {}
    waiting = list(reqs)
    aborts = [(arrive + after, rid) for rid, _, _, arrive, after in reqs if after is not None]
    step = most_running = 0
    while waiting or engine.has_unfinished_requests():
        for r in [r for r in waiting if r[3] <= step]:
            engine.add_request(r[0], None, r[2], prompt_token_ids=r[1], output_kind=OutputKind.DELTA)
            waiting.remove(r)
        engine.abort_request([rid for at, rid in aborts if at == step])
        most_running = max(most_running, len(engine.scheduler.running))
        for out in engine.step():
            for c in out.outputs:
                logprobs = None if c.logprobs is None else [sorted((t, lp.logprob) for t, lp in pos.items())
                                                            for pos in c.logprobs]
                got.setdefault(out.request_id, []).append(
                    (c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, logprobs))
        step += 1
        assert step < 2000
    engine._inflight = None  # left by an abort of the last requests, if any
    assert engine.kv_cache.usage == 0
    graphs = engine.runner.graphs
    return got, {"preemptions": engine.scheduler.num_preemptions, "most_running": most_running,
                 "advanced": graphs.steps_advanced if graphs is not None else 0}


def _completions(deltas: list | None) -> dict[int, dict]:
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


def _same(a: list, b: list) -> bool:
    """The same completions: tokens, text, finish and stop reasons, logprobs. (Not delta by delta: under
    preemption the engines schedule apart, and a request's deltas may carry its tokens a step later.)"""
    ca, cb = _completions(a), _completions(b)
    return ca.keys() == cb.keys() and all(
        {k: v for k, v in ca[i].items() if k != "logprobs"} == {k: v for k, v in cb[i].items() if k != "logprobs"}
        and _same_logprobs(ca[i]["logprobs"], cb[i]["logprobs"]) for i in ca)


def _consistent_abort(a: list | None, b: list | None) -> bool:
    """The same tokens up to the shorter, each completion at most one token apart."""
    ca, cb = _completions(a), _completions(b)
    for i in set(ca) | set(cb):
        x, y = ca.get(i, {}).get("tokens", []), cb.get(i, {}).get("tokens", [])
        n = min(len(x), len(y))
        if x[:n] != y[:n] or abs(len(x) - len(y)) > 1:
            return False
    return True


# seeds whose runs preempt, advance steps on the device and run more requests than the largest graph holds
@pytest.mark.parametrize("seed", [6, 7])
def test_random_workloads_through_the_gpus_decode_path_give_the_plain_engines_outputs(tiny_model_dir, seed):
    reqs = _workload(seed)
    reference, _ = _run(_engine(tiny_model_dir, gpu_path=False), reqs)
    got, ran = _run(_engine(tiny_model_dir, gpu_path=True), reqs)
    # the run exercised what it is for
    assert ran["preemptions"] > 0 and ran["advanced"] > 0 and ran["most_running"] > MAX_GRAPH_BATCH, ran
    aborted = {r[0] for r in reqs if r[4] is not None}
    for rid, *_ in reqs:
        if rid in aborted:
            assert _consistent_abort(reference.get(rid), got.get(rid)), (rid, reference.get(rid), got.get(rid))
        else:
            assert rid in got and _same(reference[rid], got[rid]), (rid, reference.get(rid), got.get(rid))
