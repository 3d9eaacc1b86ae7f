"""`LocalEngineClient` over an `EngineWorker` in the same process (`engine_in_ingress`), outside Serve, on the
tiny model: tokens stream per request, greedy tokens equal the offline engine's, a closed stream aborts its
request, a refusal is an `EngineError`, and every KV block returns to the pool."""

from __future__ import annotations

import asyncio

import pytest

from serving.engine_client import EngineError, LocalCall, LocalEngineClient
from serving.llm import LLM
from workers.deployment import EngineWorker
from workers.messages import GenerateRequest
from workers.sampling_params import SamplingParams


def _options(model: str, **extra) -> dict:
    return dict(model=model, dtype="float32", max_model_len=1024, kv_cache_memory="16MiB", attention_backend="torch",
                num_threads=1, **extra)


@pytest.fixture
def worker(tiny_model_dir):
    w = EngineWorker(_options(tiny_model_dir, max_num_seqs=2), max_waiting_requests=0)
    yield w
    w.shutdown()


def _request(rid: str, prompt: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _idle(worker: EngineWorker) -> bool:
    load = worker.load()
    return (load.num_running, load.num_waiting) == (0, 0) and load.num_free_kv_tokens == load.kv_capacity_tokens


def test_streams_greedy_tokens_equal_to_the_offline_engine(worker, tiny_model_dir):
    prompts = [list(range(100, 110)), list(range(300, 305))]

    async def run() -> list[list[int]]:
        client = LocalEngineClient(worker)
        streams = [await client.submit(_request(f"r{i}", p, 12)) for i, p in enumerate(prompts)]

        async def collect(stream) -> list[int]:
            outs = [out async for out in stream]
            assert outs[-1].finished and len(outs) > 1  # deltas per step, not one answer at the end
            return [t for out in outs for t in out.outputs[0].token_ids]

        tokens = await asyncio.wait_for(asyncio.gather(*map(collect, streams)), 60)
        client.close()
        return tokens

    tokens = asyncio.run(run())
    offline = LLM(**_options(tiny_model_dir))
    expected = [o.outputs[0].token_ids for o in offline.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    assert tokens == expected
    assert _idle(worker)


def test_an_unstreamed_request_comes_back_whole_in_one_output(worker):
    """`stream=False` (a non-streamed HTTP request): one output at the end with every token, the same tokens
    as streamed, and the replica's inter-token latency still counts each of its gaps."""
    prompt = list(range(100, 110))

    async def run() -> tuple[list, list]:
        client = LocalEngineClient(worker)
        whole = await client.submit(GenerateRequest("whole", prompt, _request("", prompt, 12).params, stream=False))
        streamed = await client.submit(_request("streamed", prompt, 12))

        async def drain(stream) -> list:
            return [out async for out in stream]

        outs = await asyncio.wait_for(asyncio.gather(drain(whole), drain(streamed)), 60)
        client.close()
        return outs

    itl_before = _itl_count(worker)
    whole, streamed = asyncio.run(run())
    assert len(whole) == 1 and whole[0].finished and len(streamed) > 1
    assert whole[0].outputs[0].token_ids == [t for o in streamed for t in o.outputs[0].token_ids]
    assert len(whole[0].outputs[0].token_ids) == 12
    assert _itl_count(worker) - itl_before == 2 * 11
    assert _idle(worker)


def _itl_count(worker: EngineWorker) -> float:
    return worker.metrics.registry.get_sample_value("kvrelay:inter_token_latency_seconds_count",
                                                    {"replica": worker.metrics._replica})


def test_a_closed_stream_aborts_its_request_and_a_refusal_raises(worker):
    async def run() -> EngineError:
        client = LocalEngineClient(worker)
        long = [await client.submit(_request(f"long-{i}", [5, 6, 7], 1000)) for i in range(2)]
        await anext(long[0])
        with pytest.raises(EngineError) as refused:  # two running, none may wait (max_waiting_requests=0)
            await client.submit(_request("extra", [5, 6, 7], 4))
        for stream in long:
            stream.close()
        for _ in range(200):
            if _idle(worker):
                break
            await asyncio.sleep(0.05)
        client.close()
        return refused.value

    refusal = asyncio.run(run())
    assert refusal.status == 429 and "max_waiting_requests=0" in refusal.message
    assert _idle(worker)  # the aborted requests gave back every block


def test_local_call_passes_items_errors_and_cancellation():
    closed: list[str] = []

    async def gen(fail: bool):
        try:
            yield 1
            if fail:
                raise ValueError("boom")
            await asyncio.sleep(3600)
            yield 2
        finally:
            closed.append("fail" if fail else "wait")

    async def run() -> None:
        failing = LocalCall(gen(True))
        assert await anext(failing) == 1
        with pytest.raises(ValueError, match="boom"):
            await anext(failing)
        with pytest.raises(StopAsyncIteration):
            await anext(failing)
        waiting = LocalCall(gen(False))
        assert await anext(waiting) == 1
        waiting.cancel()  # as Serve cancels a replica's generator when its caller goes away
        with pytest.raises(StopAsyncIteration):
            await anext(waiting)
        await asyncio.sleep(0)
        assert closed == ["fail", "wait"]

    asyncio.run(run())


def test_a_consumer_behind_the_engine_gets_what_queued_as_one_output(worker, tiny_model_dir):
    """Deltas queued while nobody read the stream (as when the ingress falls behind a GPU's steps) come as one
    output: every token, text and the finish, in order, the same as the offline engine's."""
    prompt = list(range(100, 110))

    async def run() -> list:
        client = LocalEngineClient(worker)
        stream = await client.submit(_request("late", prompt, 12))
        for _ in range(400):  # the request runs to its end before the stream is read
            if _idle(worker):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # the last step's outputs reach the stream's queue
        outs = [out async for out in stream]
        client.close()
        return outs

    outs = asyncio.run(run())
    offline = LLM(**_options(tiny_model_dir)).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                                                ignore_eos=True))[0].outputs[0]
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == offline.token_ids and outs[0].outputs[0].text == offline.text
    assert outs[0].outputs[0].finish_reason == "length"


def test_queued_deltas_merge_up_to_an_error_which_comes_next_and_tickets_are_kept():
    from serving.engine_client import EngineClient, RequestStream, _Subscription, _Ticket
    from workers.outputs import CompletionOutput, RequestOutput

    def delta(tokens: list[int], finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "".join(f"<{t}>" for t in tokens), tokens,
                                                                  finish_reason="length" if finished else None)],
                             finished)

    class Call:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    async def stream_of(items: list) -> RequestStream:
        client, queue, sub = EngineClient(None), asyncio.Queue(), _Subscription("replica")
        for item in items:
            queue.put_nowait(item)
        client._queues["r"] = queue
        sub.requests.add("r")
        return RequestStream(client, "r", queue, Call(), sub, asyncio.create_task(asyncio.sleep(3600)))

    async def run() -> None:
        stream = await stream_of([delta([1]), delta([2, 3]), _Ticket("ticket"), delta([4]),
                                  EngineError("the replica went away"), delta([5])])
        first = await anext(stream)
        assert first.outputs[0].token_ids == [1, 2, 3, 4] and first.outputs[0].text == "<1><2><3><4>"
        assert not first.finished and stream.kv_ticket == "ticket"
        with pytest.raises(EngineError, match="went away"):  # after what came before it, not instead
            await anext(stream)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        done = await stream_of([delta([1]), delta([2], finished=True)])
        last = await anext(done)
        assert last.finished and last.outputs[0].token_ids == [1, 2] and last.outputs[0].finish_reason == "length"
        assert done.finished and not done._stream.cancelled  # ended, not aborted
        with pytest.raises(StopAsyncIteration):
            await anext(done)

    asyncio.run(run())
