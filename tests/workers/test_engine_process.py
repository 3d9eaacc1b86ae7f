"""`EngineWorker(engine_process=True)` outside Serve, on the tiny model: the engine loop in a child process
gives the in-process loop's tokens, its errors and its load, frees every block, and ends with the replica;
a child that dies fails its requests at once."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import time

import pytest
import torch

from workers.config import EngineConfig
from workers.deployment import EngineLoopStopped, EngineWorker
from workers.engine_process import EngineProcess
from workers.messages import Accepted, GenerateRequest, Rejected
from workers.sampling_params import SamplingParams


def _config(model: str, **engine) -> dict:
    return dict(model=model, dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                attention_backend="torch", num_threads=1, **engine)


@pytest.fixture
def make_worker(tiny_model_dir):
    workers: list[EngineWorker] = []

    def make(engine_process: bool, max_waiting_requests: int | None = None, **engine) -> EngineWorker:
        workers.append(EngineWorker(_config(tiny_model_dir, **engine), max_waiting_requests,
                                    engine_process=engine_process))
        return workers[-1]

    yield make
    for w in workers:
        w.shutdown()


def _requests() -> list[GenerateRequest]:
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=9, temperature=0.8, seed=7, n=2, ignore_eos=True)
    return [GenerateRequest(f"s{i}", [3 + i, 50, 900, 7], greedy, stream=True) for i in range(3)] + [
        GenerateRequest("whole", [11, 12, 13], greedy),  # answered at its end
        GenerateRequest("seeded", [5, 6, 7, 8], seeded, stream=True),
        GenerateRequest("too-long", list(range(3, 300)), greedy),  # past max_model_len: the engine refuses it
    ]


async def _serve(worker: EngineWorker, requests: list[GenerateRequest]) -> tuple[dict, dict]:
    """Every request's tokens (per sequence index) and errors, as an ingress's subscriber stream sees them."""
    sub = worker.subscribe("sub")
    assert await anext(sub) == worker.replica_id
    tokens: dict[tuple[str, int], list[int]] = {}
    errors: dict[str, tuple[str, int]] = {}

    async def read():
        async for batch in sub:
            for out in batch.outputs:
                for seq in out.outputs:
                    tokens.setdefault((out.request_id, seq.index), []).extend(seq.token_ids)
            errors.update({rid: (e.message, e.status) for rid, e in batch.errors.items()})

    reader = asyncio.create_task(read())
    calls = [worker.generate("sub", r) for r in requests]
    assert all([isinstance(await anext(c), Accepted) for c in calls])
    for call in calls:
        async for _ in call:
            pass
    await asyncio.sleep(0.2)  # the last batch reaches the reader
    reader.cancel()
    return tokens, errors


def test_a_child_engine_gives_the_in_process_engines_tokens_errors_and_frees_every_block(make_worker):
    here, child = make_worker(False), make_worker(True)
    assert child.engine is None and child.loop.facts == here.loop.facts
    assert child.model_info() == here.model_info()
    want = asyncio.run(_serve(here, _requests()))
    got = asyncio.run(_serve(child, _requests()))
    assert got == want
    tokens, errors = got
    assert len(tokens[("s0", 0)]) == 12 and len(tokens[("seeded", 1)]) == 9
    assert set(errors) == {"too-long"} and errors["too-long"][1] == 400 and "max_model_len" in errors["too-long"][0]
    load = child.load()
    assert (load.num_running, load.num_waiting, load.num_pending_tokens) == (0, 0, 0)
    assert load.num_free_kv_tokens == load.kv_capacity_tokens
    assert child.loop.stats.kv_cache_usage == 0.0
    asyncio.run(child.check_health())


def test_admission_counts_what_was_sent_to_the_child_before_it_reports_it(make_worker):
    worker = make_worker(True, max_waiting_requests=0, max_num_seqs=2)

    async def run():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        long = [worker.generate("sub", GenerateRequest(f"long-{i}", [100, 101, 102], params)) for i in range(2)]
        assert [type(await anext(g)) for g in long] == [Accepted, Accepted]
        load = worker.load()  # at once: the child may not have stepped yet, but the replica counts both
        assert load.num_running + load.num_waiting == 2
        refusal = await anext(worker.generate("sub", GenerateRequest("extra", [100], params)))
        for g in long:
            await g.aclose()  # the caller went away: the requests are aborted in the child
        deadline = time.monotonic() + 30
        while worker.load().num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return refusal

    refusal = asyncio.run(run())
    assert isinstance(refusal, Rejected) and refusal.status == 429
    assert worker.load().num_running == 0 and worker.loop.stats.kv_cache_usage == 0.0


def test_a_killed_engine_process_fails_its_requests_at_once_and_the_health_check(make_worker):
    worker = make_worker(True)

    async def run():
        call = worker.generate("sub", GenerateRequest("long", [100, 101], SamplingParams(max_tokens=250,
                                                                                         ignore_eos=True)))
        assert isinstance(await anext(call), Accepted)
        os.kill(worker.loop.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineLoopStopped, match="engine process .* exited"):
            await asyncio.wait_for(anext(call), 10)
        assert time.monotonic() - start < 5  # not at the next health check
        with pytest.raises(EngineLoopStopped):
            await worker.check_health()

    asyncio.run(run())
    assert not worker.loop.is_alive()


def test_the_child_ends_with_the_replica_or_when_its_socket_closes(make_worker, tiny_model_dir):
    worker = make_worker(True)
    pid = worker.loop.pid
    worker.shutdown()
    assert worker.loop.exit_code == 0 and not _running(pid)

    orphan = EngineProcess(EngineConfig(**_config(tiny_model_dir)), lambda *step: None)
    orphan.start()
    orphan.close_socket()  # as when the replica's process dies
    deadline = time.monotonic() + 30
    while _running(orphan.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(orphan.pid)


def test_an_engine_the_child_cannot_build_raises_in_the_replica(tiny_model_dir):
    small = _config(tiny_model_dir, num_kv_blocks=1)  # found when the engine sizes its cache, in the child
    del small["kv_cache_memory"]
    with pytest.raises(ValueError, match="fewer than max_model_len") as here:
        EngineWorker(small)
    with pytest.raises(ValueError, match="fewer than max_model_len") as child:
        EngineWorker(small, engine_process=True)
    assert str(child.value) == str(here.value)
    with pytest.raises(ValueError, match="engine_process cannot be combined with tensor_parallel_size > 1"):
        EngineWorker(_config(tiny_model_dir, tensor_parallel_size=2), engine_process=True)


def test_kv_leaves_and_enters_a_child_engine_for_a_hand_off(tiny_model_dir):
    """A prefill-only request's KV comes back from the child with its step (as the in-process engine exports
    it), is freed when released, and a request that imports it continues as one engine would."""
    from workers.engine import Engine, KVImport
    from workers.output_processor import OutputKind

    config = EngineConfig(**_config(tiny_model_dir))
    prompt, greedy = [5, 80, 900, 33, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0)
    here = Engine(config)
    here.add_request("full", None, greedy, prompt_token_ids=prompt, output_kind=OutputKind.FINAL_ONLY)
    here.add_request("p", None, one, prompt_token_ids=prompt, output_kind=OutputKind.FINAL_ONLY, hold_kv=True)
    expected: list[int] = []
    while here.has_unfinished_requests():
        expected += [t for out in here.step() if out.finished and out.request_id == "full"
                     for t in out.outputs[0].token_ids]
    exported = here.export_kv("p")

    steps: queue.Queue = queue.Queue()
    child = EngineProcess(config, lambda outputs, errors, stats, exports: steps.put((outputs, exports, stats)))
    child.start()

    def until(done) -> tuple[list[int], dict]:
        tokens, exports = [], {}
        deadline = time.monotonic() + 60
        while not done(tokens, exports):
            outputs, more, _ = steps.get(timeout=max(0.0, deadline - time.monotonic()))
            tokens += [t for out in outputs for t in out.outputs[0].token_ids]
            exports.update(more)
        return tokens, exports

    try:
        child.add(GenerateRequest("p", prompt, one, hold_kv=True, stream=False))
        first, exports = until(lambda tokens, exports: "p" in exports)
        assert first == expected[:1] and torch.equal(exports["p"], exported)
        child.release_kv("p")
        child.add(GenerateRequest("d", prompt + first, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)),
                  KVImport(len(prompt), exports["p"]))
        rest, _ = until(lambda tokens, exports: len(tokens) == 7)
        assert first + rest == expected
        deadline = time.monotonic() + 30
        while (child.stats.kv_cache_usage or child.stats.num_kv_held) and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = child.stats
        assert (stats.kv_cache_usage, stats.num_kv_held, stats.num_kv_import_fallbacks) == (0.0, 0, 0)
    finally:
        child.stop()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
