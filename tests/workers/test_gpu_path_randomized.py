"""The GPU's decode path against the plain engine on random workloads (`loadtest/gpu_check/random_workload.py`,
whose docstring says what must hold): here on the CPU, the Triton backend in its interpreter and the decode
graphs replayed by `eager_capture`, with more requests running than the largest graph holds (eager steps
between graph steps), blocks of 4 tokens and a pool too small for the workload. The reference is the torch
backend, eager and in turn. Then the same path speculating as the engine serves by default (drafts while few
requests run, steps queued ahead while more do)."""

from __future__ import annotations

import pytest

from loadtest.gpu_check.plan import Plan
from loadtest.gpu_check.random_workload import CPU_SHAPE, VARIANTS, compare, engine_config, run, workload
from workers.cuda_graphs import eager_capture
from workers.engine import Engine

pytest.importorskip("triton", reason="triton is not installed")


def _engine(model: str, variant: str, reference: bool) -> Engine:
    """The engine the GPU check's dry run takes for `variant` (`engine_config`): the reference, eager steps in turn
    over the torch backend; or the GPU's path, its decode graphs replayed eagerly up to the variant's largest."""
    engine = Engine(engine_config(Plan.dry(), model, variant, reference))
    if not reference:
        engine.runner.enable_decode_graphs(max_batch=VARIANTS[variant].cpu_graph, max_model_len=engine.max_model_len,
                                           capture=eager_capture)
    return engine


# seeds whose runs preempt, advance steps whose rows take new blocks, and run more requests than the largest
# graph holds; over the repeating model (a penalized request's next token depends on its token in flight), a
# seed that fails when a step queued ahead leaves that token out of the penalties
@pytest.mark.parametrize("model, seed", [("tiny_model_dir", 2), ("tiny_model_dir", 6), ("repeating_model_dir", 3)])
def test_random_workloads_through_the_gpus_decode_path_give_the_plain_engines_outputs(request, model, seed):
    tiny_model_dir = request.getfixturevalue(model)
    reqs = workload(seed, CPU_SHAPE)
    assert {r.params.n for r in reqs} == {1, 2} and any(r.abort is not None for r in reqs)
    reference, _ = run(_engine(tiny_model_dir, "decode_path", reference=True), reqs)
    got, ran = run(_engine(tiny_model_dir, "decode_path", reference=False), reqs)
    assert ran["kv_usage_after"] == 0 and ran["graphs"] and ran["async_scheduling"]
    # the run exercised what it is for
    graph = VARIANTS["decode_path"].cpu_graph
    assert ran["preemptions"] > 0 and ran["blocks_advanced"] > 0 and ran["most_running"] > graph, ran
    assert compare(reqs, reference, got) == []


# a seed whose run keeps drafts and refuses some, queues steps ahead (more requests running than the limit) and
# preempts
@pytest.mark.parametrize("seed", [17])
def test_random_workloads_through_the_gpus_decode_path_speculating_give_the_plain_engines_outputs(
        repeating_model_dir, seed):
    v = VARIANTS["speculating"]
    reqs = workload(seed, v.cpu_shape, v.kinds, v.priorities)
    assert len({r.priority for r in reqs}) == v.priorities > 1
    reference, _ = run(_engine(repeating_model_dir, "speculating", reference=True), reqs)
    engine = _engine(repeating_model_dir, "speculating", reference=False)
    # the limit the engine sets from its largest graph on a GPU: as many requests as it holds with their drafts
    assert engine.scheduler.config.speculative_disable_by_batch_size == v.cpu_graph // 5
    got, ran = run(engine, reqs)
    assert ran["kv_usage_after"] == 0
    assert 0 < ran["drafts_kept"] < ran["drafts"] and ran["steps_queued_ahead"] > 0 and ran["preemptions"] > 0, ran
    # an aborted request may be a few tokens further on (a step makes up to 5): compared up to the shorter
    assert compare(reqs, reference, got, abort_slack=None) == []
