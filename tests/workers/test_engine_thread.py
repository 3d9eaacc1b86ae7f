"""One thread runs every parallel CPU kernel of an engine replica: the engine loop's thread builds the engine
(weights, warm-up) and then steps it. A second thread that ever opened an OpenMP region would leave libgomp
with more worker threads than CPUs, and its workers would then sleep between regions instead of spinning
(workers/engine_loop.py says what that cost)."""

from __future__ import annotations

import threading

import pytest

import workers.deployment
from workers.deployment import EngineWorker
from workers.engine import Engine
from workers.engine_loop import EngineLoop


def test_the_loop_builds_its_engine_on_its_own_thread_and_steps_it(tiny_model_dir):
    built_on: list[int] = []
    published = threading.Event()

    def build() -> Engine:
        built_on.append(threading.get_ident())
        return Engine(model=tiny_model_dir, dtype="float32", num_kv_blocks=64, num_threads=1)

    loop = EngineLoop(build, lambda *args: published.set())
    assert loop.engine is None
    loop.start()  # returns once built
    try:
        assert built_on == [loop._thread.ident] and loop.engine is not None and loop.stats is not None
        assert published.wait(10)  # then it steps (here: publishes its idle stats)
    finally:
        loop.stop()


def test_a_failed_build_raises_from_start():
    def build() -> Engine:
        raise ValueError("no such model")

    loop = EngineLoop(build, lambda *args: None)
    with pytest.raises(ValueError, match="no such model"):
        loop.start()
    loop._thread.join(5)
    assert not loop.is_alive()


def test_a_replica_builds_its_engine_on_the_thread_that_steps_it(tiny_model_dir, monkeypatch):
    built_on: list[int] = []

    class RecordingEngine(Engine):
        def __init__(self, *args, **kwargs) -> None:
            built_on.append(threading.get_ident())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(workers.deployment, "Engine", RecordingEngine)
    replica = EngineWorker({"model": tiny_model_dir, "dtype": "float32", "num_kv_blocks": 64, "num_threads": 1})
    try:
        assert built_on == [replica.loop._thread.ident] != [threading.get_ident()]
        assert replica.engine is replica.loop.engine
    finally:
        replica.shutdown()
