"""The GPU's decode path against the plain engine on random workloads (`loadtest/gpu_check/random_workload.py`,
whose docstring says what must hold): here on the CPU, the Triton backend in its interpreter and the decode
graphs replayed by `eager_capture`, with more requests running than the largest graph holds (eager steps
between graph steps), blocks of 4 tokens and a pool too small for the workload. The reference is the torch
backend, eager and in turn."""

from __future__ import annotations

import pytest

from loadtest.gpu_check.random_workload import CPU_SHAPE, compare, engine_options, run, workload
from workers.cuda_graphs import eager_capture
from workers.engine import Engine

pytest.importorskip("triton", reason="triton is not installed")

MAX_GRAPH_BATCH = 8


def _engine(model: str, gpu_path: bool) -> Engine:
    if not gpu_path:
        return Engine(model=model, attention_backend="torch", **engine_options(CPU_SHAPE))
    engine = Engine(model=model, attention_backend="triton", device="cpu", async_scheduling=True,
                    **engine_options(CPU_SHAPE))
    engine.runner.enable_decode_graphs(max_batch=MAX_GRAPH_BATCH, max_model_len=engine.max_model_len,
                                       capture=eager_capture)
    return engine


# seeds whose runs preempt, advance steps whose rows take new blocks, and run more requests than the largest
# graph holds
@pytest.mark.parametrize("seed", [2, 6])
def test_random_workloads_through_the_gpus_decode_path_give_the_plain_engines_outputs(tiny_model_dir, seed):
    reqs = workload(seed, CPU_SHAPE)
    assert {r.params.n for r in reqs} == {1, 2} and any(r.abort is not None for r in reqs)
    reference, _ = run(_engine(tiny_model_dir, gpu_path=False), reqs)
    got, ran = run(_engine(tiny_model_dir, gpu_path=True), reqs)
    assert ran["kv_usage_after"] == 0
    # the run exercised what it is for
    assert ran["preemptions"] > 0 and ran["blocks_advanced"] > 0 and ran["most_running"] > MAX_GRAPH_BATCH, ran
    assert compare(reqs, reference, got) == []
