"""`EngineWorker` outside Serve, on the tiny model: which requests a replica admits and how it sheds."""

from __future__ import annotations

import asyncio
import time

import pytest

from workers.admission import RETRY_AFTER_S
from workers.deployment import EngineWorker
from workers.messages import Accepted, GenerateRequest, Rejected
from workers.sampling_params import SamplingParams


@pytest.fixture
def make_worker(tiny_model_dir):
    workers: list[EngineWorker] = []

    def make(max_waiting_requests: int | None, **engine) -> EngineWorker:
        config = dict(model=tiny_model_dir, dtype="float32", max_model_len=1024, kv_cache_memory="16MiB",
                      attention_backend="torch", num_threads=1, **engine)
        workers.append(EngineWorker(config, max_waiting_requests))
        return workers[-1]

    yield make
    for w in workers:
        w.shutdown()


def _request(rid: str, max_tokens: int, n: int = 1) -> GenerateRequest:
    return GenerateRequest(rid, list(range(100, 108)), SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True))


def _rejected_total(worker: EngineWorker, reason: str) -> float:
    for line in worker.metrics.render().decode().splitlines():
        if line.startswith("kvrelay:num_requests_rejected_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no rejected counter for reason {reason}")


def test_zero_waiting_admits_what_can_start_and_sheds_the_rest(make_worker):
    worker = make_worker(0, max_num_seqs=2)

    async def run():
        idle = worker.generate("sub", _request("alone", max_tokens=4, n=3))  # n above max_num_seqs, idle replica
        assert isinstance(await anext(idle), Accepted)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(idle), 60)  # the request ran to the end
        done = worker.load()
        assert (done.num_running, done.num_waiting, done.num_pending_tokens) == (0, 0, 0)
        assert done.num_free_kv_tokens == done.kv_capacity_tokens

        long = [worker.generate("sub", _request(f"long-{i}", max_tokens=1000)) for i in range(2)]
        assert [type(await anext(g)) for g in long] == [Accepted, Accepted]
        assert worker.load().num_running + worker.load().num_waiting == 2
        shed = worker.generate("sub", _request("extra", max_tokens=4))
        refusal = await anext(shed)
        for g in long:
            await g.aclose()  # the caller went away: the requests are aborted
        return refusal

    refusal = asyncio.run(run())
    assert isinstance(refusal, Rejected)
    assert (refusal.status, refusal.type, refusal.retry_after) == (429, "server_overloaded", RETRY_AFTER_S)
    assert "max_waiting_requests=0" in refusal.message and "max_num_seqs=2" in refusal.message
    assert _rejected_total(worker, "queue_full") == 1
    assert _rejected_total(worker, "kv_cache_full") == 0


def test_no_limit_admits_beyond_the_running_batch(make_worker):
    worker = make_worker(None, max_num_seqs=1)

    async def run():
        gens = [worker.generate("sub", _request(f"r{i}", max_tokens=1000)) for i in range(3)]
        firsts = [await anext(g) for g in gens]
        for g in gens:
            await g.aclose()
        return firsts

    assert all(isinstance(m, Accepted) for m in asyncio.run(run()))


def test_disconnected_and_finished_requests_leave_no_per_request_state(make_worker):
    """Callers that go away mid-stream while the engine is stepping, beside requests that finish: once
    the replica is idle, nothing of theirs stays behind (a soak would otherwise grow without bound)."""
    worker = make_worker(None)
    step = worker.engine.step

    def slow_step():  # a step takes long enough that the callers always leave while one runs
        outputs = step()
        time.sleep(0.02)
        return outputs

    worker.engine.step = slow_step

    async def run():
        sub = worker.subscribe("sub")
        await anext(sub)  # the replica id
        cut = [worker.generate("sub", _request(f"cut-{i}", max_tokens=1000)) for i in range(6)]
        done = [worker.generate("sub", _request(f"done-{i}", max_tokens=3)) for i in range(3)]
        assert all(isinstance(m, Accepted) for m in [await anext(g) for g in cut + done])
        seen: set[str] = set()
        while not {f"cut-{i}" for i in range(6)} <= seen:
            batch = await asyncio.wait_for(anext(sub), 60)
            seen.update(o.request_id for o in batch.outputs if o.outputs[0].token_ids)
        for g in cut:
            await g.aclose()  # the caller went away while the engine keeps stepping
        for g in done:
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(anext(g), 60)
        for _ in range(100):
            if worker.load().num_running == 0 and not worker.engine.outputs.request_ids:
                break
            await asyncio.sleep(0.1)
        await sub.aclose()

    asyncio.run(run())
    assert worker._in_flight == {} and worker._subscribers == {}
    assert not worker.engine.outputs.request_ids and not worker.engine.scheduler.requests
