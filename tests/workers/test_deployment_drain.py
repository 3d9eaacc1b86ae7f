"""A stopping engine replica ends what it still runs by its own clock: from the moment Serve starts stopping
it, requests have `drain_timeout_s` to finish, the rest are aborted (their KV blocks back in the pool) and
end with `ReplicaStopping` (also sent on their subscriber streams); then those streams end and new requests
are refused. Built outside Serve, with the stop flag Serve would set (`workers.replica_drain.serve_stop_flag`)
replaced by a list."""

from __future__ import annotations

import asyncio
import time

import pytest

from workers.deployment import EngineWorker
from workers.messages import Accepted, GenerateRequest, Rejected
from workers.replica_drain import ReplicaStopping, serve_stop_flag
from workers.sampling_params import SamplingParams


@pytest.fixture
def worker(tiny_model_dir):
    replica = EngineWorker({"model": tiny_model_dir, "dtype": "float32", "num_kv_blocks": 64, "num_threads": 1},
                           drain_timeout_s=3.0)
    yield replica
    replica.shutdown()


def _request(rid: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def _run(worker: EngineWorker, rid: str, max_tokens: int) -> float:
    stream = worker.generate("ingress", _request(rid, max_tokens))
    assert isinstance(await stream.__anext__(), Accepted)
    async for _ in stream:
        pass
    return time.monotonic()


def test_outside_serve_there_is_no_stop_flag():
    assert serve_stop_flag() is None


def test_a_stopping_replica_lets_short_requests_finish_and_cuts_the_rest_at_drain_timeout(worker, monkeypatch):
    stopping = [False]
    worker._stop_flag = lambda: stopping[0]
    step = worker.engine.step

    def slow_step(*args, **kwargs):  # at least 10 ms a step, so 1,000 tokens outlast the 3 s drain
        time.sleep(0.01)
        return step(*args, **kwargs)

    monkeypatch.setattr(worker.engine, "step", slow_step)

    async def run():
        subscription = worker.subscribe("ingress")
        assert await subscription.__anext__() == worker.replica_id
        batches = asyncio.ensure_future(_drain_stream(subscription))
        short = asyncio.ensure_future(_run(worker, "short", 4))
        long = asyncio.ensure_future(_run(worker, "long", 1000))
        await asyncio.sleep(0.3)
        stopping[0] = True
        start = time.monotonic()
        assert await asyncio.wait_for(short, 30) - start < 3.0  # finished inside the drain
        with pytest.raises(ReplicaStopping, match=r"shutting down .* drain_timeout_s=3 s"):
            await asyncio.wait_for(long, 30)
        assert 2.9 < time.monotonic() - start < 10
        # the subscriber stream ended (nothing runs here any more), and its last batch says why the long
        # request ended: the ingress may see this stream close before the generate call's error
        last = (await asyncio.wait_for(batches, 5))[-1]
        assert list(last.errors) == ["long"] and last.errors["long"].status == 503
        assert "shutting down" in last.errors["long"].message
        refused = worker.generate("ingress", _request("late", 4))
        reply = await refused.__anext__()
        assert isinstance(reply, Rejected) and reply.status == 503 and "shutting down" in reply.message

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while worker.loop.stats.num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.loop.stats.num_running == 0 and worker.loop.stats.kv_cache_usage == 0


def test_an_idle_stopping_replica_ends_its_subscriber_streams_at_once(worker):
    stopping = [True]
    worker._stop_flag = lambda: stopping[0]

    async def run():
        subscription = worker.subscribe("ingress")
        assert await subscription.__anext__() == worker.replica_id
        await asyncio.wait_for(_drain_stream(subscription), 5)

    asyncio.run(run())


async def _drain_stream(stream) -> list:
    return [batch async for batch in stream]
