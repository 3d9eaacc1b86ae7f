"""The engine replica's health as Serve sees it (`EngineWorker.check_health`), on a replica built outside
Serve: a run of failed engine steps or a stopped engine loop is unhealthy, and the requests waiting on a
stopped loop fail at once instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from workers.deployment import EngineLoopStopped, EngineWorker
from workers.messages import Accepted, GenerateRequest
from workers.sampling_params import SamplingParams


@pytest.fixture
def worker(tiny_model_dir):
    replica = EngineWorker({"model": tiny_model_dir, "dtype": "float32", "num_kv_blocks": 64, "num_threads": 1},
                           max_failed_steps=2)
    yield replica
    replica.shutdown()


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0))


async def _serve_one(worker: EngineWorker, rid: str) -> None:
    stream = worker.generate("ingress", _request(rid))
    assert isinstance(await stream.__anext__(), Accepted)
    async for _ in stream:
        pass


def test_a_healthy_replica_passes_and_reports_its_start(worker):
    asyncio.run(_serve_one(worker, "ok"))
    asyncio.run(worker.check_health())
    times = worker.startup_times()
    assert times["process_started"] <= times["constructor_started"] <= times["engine_ready"]


def test_failed_steps_in_a_row_make_it_unhealthy_until_a_step_succeeds(worker, monkeypatch):
    step = worker.engine.step

    def broken():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(worker.engine, "step", broken)
    asyncio.run(_serve_one(worker, "a"))
    asyncio.run(worker.check_health())  # one failure is not a run
    asyncio.run(_serve_one(worker, "b"))
    with pytest.raises(RuntimeError, match="last 2 engine steps .* failed"):
        asyncio.run(worker.check_health())
    monkeypatch.setattr(worker.engine, "step", step)
    asyncio.run(_serve_one(worker, "c"))
    asyncio.run(worker.check_health())


def test_a_stopped_engine_loop_fails_its_requests_and_the_health_check(worker):
    worker.loop.stop()

    async def run() -> None:
        stream = worker.generate("ingress", _request("stuck"))
        assert isinstance(await stream.__anext__(), Accepted)
        rest = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not rest.done()  # nobody steps the engine any more
        with pytest.raises(EngineLoopStopped, match="engine loop .* has stopped"):
            await worker.check_health()
        with pytest.raises(EngineLoopStopped):
            await asyncio.wait_for(rest, 5)

    asyncio.run(run())


def test_max_failed_steps_must_be_positive():
    with pytest.raises(ValueError, match="max_failed_steps must be >= 1"):
        EngineWorker(max_failed_steps=0)
