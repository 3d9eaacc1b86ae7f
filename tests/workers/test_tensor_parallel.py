"""Tensor parallelism: how heads, features and vocabulary split over ranks, and an engine spread over Ray
rank actors (gloo on the CPU) that generates the same greedy tokens as one process, in float32. A lost
rank fails the step whole, the replica's health check and the requests in flight, without a hang."""

from __future__ import annotations

import asyncio

import pytest

from serving import LLM, SamplingParams
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


@pytest.fixture(scope="module")
def prompts(make_prompts):
    return make_prompts([5, 40, 70])


def _greedy_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params)]


def test_tiny_model_tp2_matches_one_process(ray_session, tiny_model_dir, prompts):
    """Chunked prefill (a 32-token budget), n=2 and a shared prefix (the repeated prompt) on two ranks."""
    options = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, num_threads=2)
    batch = prompts + [prompts[1]]
    params = SamplingParams(n=2, max_tokens=8, temperature=0.0)
    expected = _greedy_tokens(LLM(tiny_model_dir, **options), batch, params)
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **options)
    try:
        assert llm.engine.model is None and len(llm.engine.runner.workers) == 2
        assert _greedy_tokens(llm, batch, params) == expected
        stats = llm.engine.get_stats()
        assert stats.prefix_cache_hits > 0 and stats.kv_cache_usage == 0.0
    finally:
        llm.engine.shutdown()


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
