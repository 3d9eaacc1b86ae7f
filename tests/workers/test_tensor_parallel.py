"""Tensor parallelism: how heads, features and vocabulary split over ranks, and an engine spread over Ray
rank actors (gloo on the CPU) that generates the same greedy tokens as one process, in float32, and hands
KV off to and from engines of other sizes. Prefix cache hits, preemption, chunked prefill, seeded `n > 1`
sampling and the metrics behave as in one process. A lost rank fails the step whole, the replica's health
check and the requests in flight, without a hang."""

from __future__ import annotations

import asyncio
import re
from dataclasses import fields, replace

import pytest
from serving_helpers import metric_sum, parse_metrics

from serving import LLM, SamplingParams, StructuredOutputsParams
from workers.engine import Engine, EngineStats, KVImport
from workers.metrics import EngineMetrics
from workers.output_processor import OutputKind
from workers.step_isolation import RunnerUnavailable
from workers.tensor_parallel import check_tp_size, partition

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def test_heads_features_and_vocabulary_split_evenly():
    parts = [partition(r, 3, 9, 3, 1536, 49152) for r in range(3)]  # SmolLM2-135M over 3 ranks
    assert [p.heads for p in parts] == [(0, 3), (3, 6), (6, 9)]
    assert [p.kv_heads for p in parts] == [(0, 1), (1, 2), (2, 3)]
    assert [p.intermediate for p in parts] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [p.vocab for p in parts] == [(0, 16384), (16384, 32768), (32768, 49152)]


def test_fewer_kv_heads_than_ranks_are_replicated_beside_their_query_heads():
    parts = [partition(r, 4, 8, 2, 64, 10) for r in range(4)]
    assert [p.kv_heads for p in parts] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # query heads 0-3 read KV head 0
    assert [p.vocab for p in parts] == [(0, 3), (3, 6), (6, 9), (9, 10)] and parts[3].vocab_rows == 3


@pytest.mark.parametrize("size, shape, message", [
    (2, (9, 3, 1536), "9 attention heads"),
    (4, (8, 6, 64), "6 KV heads"),
    (3, (9, 3, 100), "intermediate size 100"),
])
def test_sizes_that_do_not_divide_are_refused(size, shape, message):
    with pytest.raises(ValueError, match=message):
        check_tp_size(size, *shape)


def test_an_engine_refuses_a_size_its_model_does_not_split_before_starting_ranks(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide its 4 attention heads"):
        LLM(tiny_model_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="Ray gives each rank its own"):
        LLM(tiny_model_dir, tensor_parallel_size=2, device="cuda:1")


@pytest.fixture(scope="module")
def prompts(make_prompts):
    return make_prompts([5, 40, 70])


def _token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[list[int]]]:
    """Each prompt's completions' token ids."""
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params)]


# 8 blocks of 16 tokens: the batch below preempts a sequence once
TINY = dict(dtype="float32", num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=32, num_threads=2)


@pytest.fixture(scope="module")
def tiny_tp1(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, **TINY)


@pytest.fixture(scope="module")
def tiny_tp2(ray_session, tiny_model_dir):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **TINY)
    yield llm
    llm.engine.shutdown()


def test_tiny_model_tp2_matches_one_process(tiny_tp1, tiny_tp2, prompts):
    """Chunked prefill (a 32-token budget), n=2, a shared prefix (the repeated prompt) and preemption (a
    small cache) on two ranks."""
    batch = prompts + [prompts[1]]
    params = SamplingParams(n=2, max_tokens=8, temperature=0.0)
    expected = _token_ids(tiny_tp1, batch, params)
    assert tiny_tp2.engine.model is None and len(tiny_tp2.engine.runner.workers) == 2
    assert _token_ids(tiny_tp2, batch, params) == expected
    stats = tiny_tp2.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0 and stats.kv_cache_usage == 0.0


def test_tp2_sampling_inputs_reach_rank_0(tiny_tp1, tiny_tp2, prompts):
    """What the sampler needs beyond the logits travels with the step: token histories (penalties), bans
    (bad words, min_tokens), logit bias, a grammar's bitmask and the prompt-logprobs rows (over a chunked
    prompt); two ranks pick the tokens one process does."""
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.3, logit_bias={8085: 6.0}),
        SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8, bad_words=[" robot paints"], prompt_logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,40}")),
    ]
    one, two = tiny_tp1.generate(prompts, params), tiny_tp2.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in two] == [list(o.outputs[0].token_ids) for o in one]
    assert re.fullmatch("[a-z ]{1,40}", two[2].outputs[0].text)
    expected, got = one[1].prompt_logprobs, two[1].prompt_logprobs
    assert len(got) == len(prompts[1]) and got[0] is None and all(e is not None for e in got[1:])
    for e, g in zip(expected[1:], got[1:]):
        assert g.keys() == e.keys()
        assert [g[t].logprob for t in g] == pytest.approx([e[t].logprob for t in g], abs=1e-4)
    assert not tiny_tp2.engine.structured.active and tiny_tp2.engine.kv_cache.usage == 0.0


def _hand_off(prefill: Engine, decode: Engine, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Prefill `prompt` and its first token on one engine, then decode the rest on the other from its KV."""
    def run(engine: Engine) -> list[int]:
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() if out.finished for t in out.outputs[0].token_ids]
        return tokens

    prefill.add_request(rid, None, SamplingParams(max_tokens=1, temperature=0.0), prompt_token_ids=prompt,
                        output_kind=OutputKind.FINAL_ONLY, hold_kv=True)
    first = run(prefill)
    payload = prefill.export_kv(rid)
    assert prefill.release_kv(rid)
    decode.add_request(rid, None, SamplingParams(max_tokens=max_tokens - 1, temperature=0.0),
                       prompt_token_ids=prompt + first, output_kind=OutputKind.FINAL_ONLY,
                       kv_import=KVImport(len(prompt), payload))
    return first + run(decode)


def test_kv_hands_off_between_pools_of_any_tensor_parallel_size(tiny_tp1, tiny_tp2, prompts):
    """The payload holds all KV heads, so TP-2 to TP-2, TP-2 to TP-1 and TP-1 to TP-2 all continue as one
    process would."""
    expected = _token_ids(tiny_tp1, [prompts[1]], GREEDY)[0][0]
    one, two = tiny_tp1.engine, tiny_tp2.engine
    assert _hand_off(two, two, "2to2", prompts[1], 8) == expected
    assert _hand_off(two, one, "2to1", prompts[1], 8) == expected
    assert _hand_off(one, two, "1to2", prompts[1], 8) == expected
    assert two.get_stats().num_kv_import_fallbacks == 0 and two.kv_cache.usage == 0.0


FIXED = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _stats_delta(engine: Engine, run) -> tuple[object, EngineStats]:
    """`run()`'s result and how the engine's cumulative stats moved while it ran."""
    before = engine.get_stats()
    result = run()
    after = engine.get_stats()
    return result, replace(after, **{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(after)
                                      if isinstance(getattr(after, f.name), int)})


def _step_by_hand(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]],
                  metrics: EngineMetrics | None = None) -> tuple[dict[str, list[int]], dict[str, int], list[tuple]]:
    """Run `requests` (id -> prompt, params; added in order) to the end one `step()` at a time. Returns each
    request's tokens, the step that gave its first token, and per step what the engine reports (running,
    waiting, KV usage, and the preemptions, prompt and generation tokens since the start), observed by
    `metrics` if given."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, None, params, prompt_token_ids=prompt, output_kind=OutputKind.DELTA)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    first: dict[str, int] = {}
    trajectory = []
    start = engine.get_stats()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, len(trajectory) + 1)
                tokens[out.request_id] += out.outputs[0].token_ids
        s = engine.get_stats()
        trajectory.append((s.num_running, s.num_waiting, s.kv_cache_usage, s.num_preemptions - start.num_preemptions,
                           s.prompt_tokens - start.prompt_tokens, s.generation_tokens - start.generation_tokens))
        if metrics is not None:
            metrics.observe_step(s, outputs)
    return tokens, first, trajectory


def test_tp2_reads_prefix_cache_hits_from_the_ranks_caches(tiny_tp1, tiny_tp2, make_prompts):
    """A prompt sharing four full blocks (64 tokens) with one that ran two requests earlier finds them
    cached: the hits are counted, only its own tail is computed, and its tokens are one process's (so the
    ranks' cache shards kept the first prompt's KV in those blocks while another request ran)."""
    prefix, tail_a, tail_b, other = make_prompts([64, 10, 12, 10], seed=4000)
    first, second = prefix + tail_a, prefix + tail_b
    results = []
    for llm in (tiny_tp1, tiny_tp2):
        for prompt, hits in ((first, 0), (other, 0), (second, 64)):
            tokens, delta = _stats_delta(llm.engine, lambda: _token_ids(llm, [prompt], FIXED)[0][0])
            assert delta.prefix_cache_hits == hits and delta.prefix_cache_queries == len(prompt)
            assert delta.computed_tokens == len(prompt) - hits + FIXED.max_tokens - 1
            results.append(tokens)
    assert results[3:] == results[:3]
    assert tiny_tp2.engine.kv_cache.usage == 0.0


def test_tp2_preempts_and_recomputes_as_one_process(tiny_tp1, tiny_tp2, make_prompts):
    """Three 40-token prompts that each grow to 80 tokens (5 blocks of the 8): two run, outgrow the cache
    and one is preempted, its KV freed and later recomputed on the ranks."""
    prompts = make_prompts([40, 40, 40], seed=8000)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    results = []
    for llm in (tiny_tp1, tiny_tp2):
        tokens, delta = _stats_delta(llm.engine, lambda: _token_ids(llm, prompts, params))
        assert delta.num_preemptions > 0 and llm.engine.kv_cache.usage == 0.0
        assert all(len(t[0]) == 40 for t in tokens)
        results.append(tokens)
    assert results[1] == results[0]


def test_tp2_chunks_a_long_prefill_beside_decodes_as_one_process(tiny_tp1, tiny_tp2, make_prompts):
    """A 100-token prompt under a 32-token step budget is prefilled over four steps, in the same batches
    as a short request's decodes; every step's mix gives the tokens one process does."""
    short, long = make_prompts([10, 100], seed=12000)
    assert len(long) > 3 * TINY["max_num_batched_tokens"]
    requests = {"chunk-short": (short, FIXED), "chunk-long": (long, FIXED)}
    one = _step_by_hand(tiny_tp1.engine, requests)
    two = _step_by_hand(tiny_tp2.engine, requests)
    tokens, first, _ = two
    assert first == {"chunk-short": 1, "chunk-long": 4}  # 22 + 31 + 31 + 16 prompt tokens
    assert all(len(t) == 8 for t in tokens.values())
    assert two[:2] == one[:2]


def test_tp2_seeded_n2_sampling_equals_one_process(tiny_tp1, tiny_tp2, make_prompts):
    """Random sampling with a seed is bit-identical across tensor-parallel sizes: each of a request's `n`
    sequences draws from its own generator (seed + index) on rank 0, and float32 logits differ too little
    between one and two ranks to change a draw. The two sequences differ, and TP-2 repeats itself."""
    prompts = make_prompts([12, 33], seed=16000)
    params = SamplingParams(n=2, max_tokens=8, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    expected = _token_ids(tiny_tp1, prompts, params)
    got = _token_ids(tiny_tp2, prompts, params)
    assert got == expected
    assert all(len(seqs) == 2 and seqs[0] != seqs[1] for seqs in got)
    assert _token_ids(tiny_tp2, prompts, params) == got


def test_tp2_reports_the_metrics_of_one_process(tiny_tp1, tiny_tp2, make_prompts):
    """Step by step the engine reports the same running and waiting counts, KV cache usage and token
    counts with two ranks as with one, and the Prometheus counters add up to the workload."""
    prompts = make_prompts([20, 45], seed=19000)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    requests = {f"metrics-{i}": (p, params) for i, p in enumerate(prompts)}
    runs, moved = [], []
    for llm in (tiny_tp1, tiny_tp2):
        metrics = EngineMetrics("r0")
        metrics.observe_step(llm.engine.get_stats(), [])  # what earlier tests counted
        before = parse_metrics(metrics.render().decode())
        tokens, _, trajectory = _step_by_hand(llm.engine, requests, metrics)
        after = parse_metrics(metrics.render().decode())
        runs.append((tokens, trajectory))
        moved.append({name: metric_sum(after, name) - metric_sum(before, name) for name in (
            "kvrelay:prompt_tokens_total", "kvrelay:generation_tokens_total", "kvrelay:request_success_total",
            "kvrelay:num_preemptions_total", "kvrelay:prefix_cache_queries_total")})
        assert max(t[2] for t in trajectory) > 0 and metric_sum(after, "kvrelay:kv_cache_usage_perc") == 0.0
        assert metric_sum(after, "kvrelay:num_requests_running") == 0
    assert runs[1] == runs[0]
    assert moved[1] == moved[0] == {"kvrelay:prompt_tokens_total": 65, "kvrelay:generation_tokens_total": 12,
                                    "kvrelay:request_success_total": 2, "kvrelay:num_preemptions_total": 0,
                                    "kvrelay:prefix_cache_queries_total": 65}


def test_smollm2_tp3_matches_one_process(ray_session, default_model_dir, prompts):
    """9 query heads and 3 KV heads: one KV head per rank."""
    options = dict(dtype="float32", max_model_len=256, kv_cache_memory="32MiB", num_threads=3)
    expected = _token_ids(LLM(default_model_dir, **options), prompts[:2])
    llm = LLM(default_model_dir, tensor_parallel_size=3, **options)
    try:
        assert _token_ids(llm, prompts[:2]) == expected
    finally:
        llm.engine.shutdown()


def test_a_killed_rank_fails_the_step_the_health_check_and_the_requests(ray_session, tiny_model_dir):
    from workers.deployment import EngineWorker
    from workers.messages import Accepted, GenerateRequest, Rejected, RequestError

    worker = EngineWorker({"model": tiny_model_dir, "dtype": "float32", "num_kv_blocks": 64, "num_threads": 2,
                           "tensor_parallel_size": 2, "distributed_timeout_s": 60})

    async def serve_one(rid: str) -> None:
        stream = worker.generate("ingress", GenerateRequest(rid, [1, 2, 3, 4], SamplingParams(max_tokens=4)))
        assert isinstance(await stream.__anext__(), Accepted)
        async for _ in stream:
            pass

    try:
        asyncio.run(serve_one("before"))
        asyncio.run(worker.check_health())
        ray_session.kill(worker.engine.runner.workers[1])
        errors: list[dict[str, RequestError]] = []
        publish = worker.loop._publish

        def spy(outputs, errs, *rest) -> None:  # what the loop reports, on its way to the replica
            errors.append(dict(errs))
            publish(outputs, errs, *rest)

        worker.loop._publish = spy
        asyncio.run(asyncio.wait_for(serve_one("after"), 60))  # ends (with an error), never hangs
        assert any("after" in e and "rank" in e["after"].message and e["after"].status == 500 for e in errors)
        with pytest.raises(RunnerUnavailable, match="rank"):
            asyncio.run(worker.check_health())
        assert worker.engine.runner.workers == []  # the survivors were stopped too

        async def refused():
            return await worker.generate("ingress", GenerateRequest("later", [1, 2], SamplingParams())).__anext__()

        rejected = asyncio.run(refused())
        assert isinstance(rejected, Rejected) and rejected.status == 503 and "replaced" in rejected.message
    finally:
        worker.shutdown()
