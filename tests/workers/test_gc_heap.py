"""A serving process's heap, frozen out of the garbage collector's passes once its engine is built
(`workers/gc_heap.py`)."""

import gc
import weakref

import pytest

from loadtest.gpu_check.engines import make_engine, release_memory
from loadtest.gpu_check.plan import Plan
from serving.llm import LLM
from workers.gc_heap import ENV, freeze_startup_heap
from workers.sampling_params import SamplingParams


def tracked(obj: object) -> bool:
    """Whether the collector's passes still walk `obj` (frozen objects are left out of `gc.get_objects`)."""
    return any(o is obj for o in gc.get_objects())


def test_the_gpu_checks_engine_and_what_was_alive_before_it_are_frozen(tiny_model_dir, monkeypatch) -> None:
    """The GPU check's engines (and `host-step`'s) freeze the heap once built, as a Serve replica's is once it
    has started, so they measure the engine as a replica runs it."""
    monkeypatch.delenv(ENV, raising=False)
    before = [object()]  # a list is tracked; alive before the engine, so frozen with its heap
    assert tracked(before)
    engine = make_engine(Plan.dry(), tiny_model_dir, "float32", "cpu", "triton", True, max_num_seqs=2)
    assert gc.get_freeze_count() > 0
    for obj in (before, engine, engine.scheduler, engine.runner, engine.runner.graphs, engine.outputs):
        assert not tracked(obj), type(obj).__name__
    later = [object()]  # what requests make afterwards is collected as usual
    assert tracked(later)
    del engine
    release_memory()  # thawed and collected: the CPU's graph stand-in holds its runner in a cycle


def test_an_llm_leaves_the_users_heap_as_it_is(tiny_model_dir, monkeypatch) -> None:
    """`LLM` runs in the user's own process: what the user made is theirs to have collected."""
    monkeypatch.delenv(ENV, raising=False)
    mine = [object()]
    llm = LLM(tiny_model_dir, dtype="float32", max_model_len=128, num_kv_blocks=32)
    assert tracked(mine) and tracked(llm.engine)


def test_the_freeze_is_turned_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "0")
    alive = [object()]
    assert freeze_startup_heap() == 0 and tracked(alive)
    monkeypatch.setenv(ENV, "1")
    assert freeze_startup_heap() > 0 and not tracked(alive)


def test_garbage_is_collected_before_the_freeze(monkeypatch) -> None:
    """A cycle dropped before the freeze is freed by it, not kept for good in the permanent generation."""
    monkeypatch.delenv(ENV, raising=False)

    class Node:
        pass
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    freeze_startup_heap()
    assert gone() is None


def detached_capture(fn, pool):
    """Like `cuda_capture`, the replay keeps no Python reference to the step it captured (a CUDA graph is the
    device's); it replays nothing here, which the test does not need."""
    out = fn()
    return (lambda: None), out


ENGINES = {
    "defaults": {},
    "torch backend": {"attention_backend": "torch"},
    "graphs, async": {"attention_backend": "triton", "graphs": True, "async_scheduling": True,
                      "num_speculative_tokens": 0},
    "graphs, drafts": {"attention_backend": "triton", "graphs": True, "num_speculative_tokens": 3},
    "prefix caching": {"enable_prefix_caching": True},
}


@pytest.mark.parametrize("case", ENGINES)
def test_a_dropped_engine_is_freed_without_the_collector(tiny_model_dir, monkeypatch, case) -> None:
    """Frozen objects in a reference cycle are never collected, so an engine dropped after requests ran in a
    frozen process (the GPU check's engines one after another, a test's after a replica's start) must go by its
    references alone, its KV cache and model with it: nothing in it may hold a cycle back to it."""
    monkeypatch.delenv(ENV, raising=False)
    options = dict(ENGINES[case])
    graphs = options.pop("graphs", False)
    llm = LLM(tiny_model_dir, dtype="float32", max_model_len=128, num_kv_blocks=32, max_num_seqs=4, **options)
    if graphs:
        llm.engine.runner.enable_decode_graphs(4, llm.engine.max_model_len, capture=detached_capture)
    freeze_startup_heap()  # as a replica's start, a rank's and the GPU check's engines freeze it
    out = llm.generate(["hello there", [5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=6, temperature=0.0))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    del out
    engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.model)
    runner, cache = weakref.ref(llm.engine.runner), weakref.ref(llm.engine.runner.kv_cache)
    gc.disable()
    try:
        del llm
        assert [r() is None for r in (engine, model, runner, cache)] == [True] * 4
    finally:
        gc.enable()
