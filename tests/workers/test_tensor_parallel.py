"""Tensor parallelism: how heads, features and vocabulary split over ranks, and an engine spread over Ray
rank actors (gloo on the CPU) that generates the same greedy tokens as one process, in float32, and hands
KV off to and from engines of other sizes. A lost rank fails the step whole, the replica's health check
and the requests in flight, without a hang."""

from __future__ import annotations

import asyncio
import re

import pytest

from serving import LLM, SamplingParams, StructuredOutputsParams
from workers.engine import Engine, KVImport
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


def _greedy_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
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
    expected = _greedy_tokens(tiny_tp1, batch, params)
    assert tiny_tp2.engine.model is None and len(tiny_tp2.engine.runner.workers) == 2
    assert _greedy_tokens(tiny_tp2, batch, params) == expected
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
    expected = _greedy_tokens(tiny_tp1, [prompts[1]], GREEDY)[0][0]
    one, two = tiny_tp1.engine, tiny_tp2.engine
    assert _hand_off(two, two, "2to2", prompts[1], 8) == expected
    assert _hand_off(two, one, "2to1", prompts[1], 8) == expected
    assert _hand_off(one, two, "1to2", prompts[1], 8) == expected
    assert two.get_stats().num_kv_import_fallbacks == 0 and two.kv_cache.usage == 0.0


def test_smollm2_tp3_matches_one_process(ray_session, default_model_dir, prompts):
    """9 query heads and 3 KV heads: one KV head per rank."""
    options = dict(dtype="float32", max_model_len=256, kv_cache_memory="32MiB", num_threads=3)
    expected = _greedy_tokens(LLM(default_model_dir, **options), prompts[:2])
    llm = LLM(default_model_dir, tensor_parallel_size=3, **options)
    try:
        assert _greedy_tokens(llm, prompts[:2]) == expected
    finally:
        llm.engine.shutdown()


def test_a_killed_rank_fails_the_step_the_health_check_and_the_requests(ray_session, tiny_model_dir):
    from workers.deployment import EngineWorker
    from workers.messages import Accepted, GenerateRequest, Rejected

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
        errors: list[dict[str, str]] = []
        publish = worker.loop._publish

        def spy(outputs, errs, *rest) -> None:  # what the loop reports, on its way to the replica
            errors.append(dict(errs))
            publish(outputs, errs, *rest)

        worker.loop._publish = spy
        asyncio.run(asyncio.wait_for(serve_one("after"), 60))  # ends (with an error), never hangs
        assert any("after" in e and "rank" in e["after"] for e in errors)
        with pytest.raises(RunnerUnavailable, match="rank"):
            asyncio.run(worker.check_health())
        assert worker.engine.runner.workers == []  # the survivors were stopped too

        async def refused():
            return await worker.generate("ingress", GenerateRequest("later", [1, 2], SamplingParams())).__anext__()

        rejected = asyncio.run(refused())
        assert isinstance(rejected, Rejected) and rejected.status == 503 and "replaced" in rejected.message
    finally:
        worker.shutdown()
