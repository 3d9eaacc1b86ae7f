"""Inter-token latency is measured where tokens are made (the engine's output processor), once per request per
step that gives it tokens, so it counts the same whether a request streams every step, every
`stream_interval` steps, or is answered whole at its end; and no per-request state outlives its request."""

from __future__ import annotations

import pytest

from workers.engine import Engine, EngineStats
from workers.metrics import EngineMetrics
from workers.output_processor import OutputKind
from workers.outputs import CompletionOutput, RequestOutput
from workers.sampling_params import SamplingParams

MAX_TOKENS = 8


def _engine(tiny_model_dir: str, interval: int = 1) -> Engine:
    return Engine(model=tiny_model_dir, dtype="float32", num_kv_blocks=64, num_threads=1, stream_interval=interval)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _run(engine: Engine, metrics: EngineMetrics) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished_requests():
        step = engine.step()
        metrics.observe_step(engine.get_stats(), step)
        outputs += step
    return outputs


def _count(histogram) -> int:
    return int(sum(b.get() for b in histogram._buckets))


@pytest.mark.parametrize("kind,interval", [(OutputKind.DELTA, 1), (OutputKind.DELTA, 3), (OutputKind.FINAL_ONLY, 1),
                                           (OutputKind.CUMULATIVE, 1)])
def test_one_gap_per_token_step_whatever_the_output_kind(tiny_model_dir, kind, interval):
    engine, metrics = _engine(tiny_model_dir, interval), EngineMetrics("r0")
    engine.add_request("a", None, _params(), prompt_token_ids=[1, 5, 9, 200], output_kind=kind)
    engine.add_request("b", None, _params(), prompt_token_ids=list(range(100, 130)), output_kind=kind)
    outputs = _run(engine, metrics)
    assert metrics.itl.sample("count") == 2 * (MAX_TOKENS - 1)
    assert metrics.itl.sample("sum") > 0
    assert _count(metrics.ttft) == _count(metrics.e2e) == 2
    if kind is OutputKind.FINAL_ONLY:
        assert sorted((o.request_id, len(o.outputs[0].token_ids)) for o in outputs) == [("a", MAX_TOKENS),
                                                                                         ("b", MAX_TOKENS)]


def test_each_call_takes_the_gaps_once(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    engine.add_request("a", None, _params(), prompt_token_ids=[1, 5, 9], output_kind=OutputKind.FINAL_ONLY)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.get_stats().token_gaps) == MAX_TOKENS - 1
    assert engine.get_stats().token_gaps == []


def test_gaps_nobody_takes_stay_bounded(tiny_model_dir, monkeypatch):
    """The offline `LLM` never calls get_stats(): its untaken gaps keep only the latest, not one per token."""
    monkeypatch.setattr("workers.output_processor._MAX_UNTAKEN_GAPS", 5)
    engine = _engine(tiny_model_dir)
    for i in range(3):
        engine.add_request(f"r{i}", None, _params(), prompt_token_ids=[3, 4, 5 + i], output_kind=OutputKind.FINAL_ONLY)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.get_stats().token_gaps) == 5


def test_aborted_and_finished_requests_leave_no_state(tiny_model_dir):
    engine, metrics = _engine(tiny_model_dir), EngineMetrics("r0")
    for i in range(6):
        engine.add_request(f"r{i}", None, _params(), prompt_token_ids=[3, 4, 5 + i], output_kind=OutputKind.DELTA)
    engine.step()
    engine.step()
    engine.abort_request(["r0", "r3"])
    _run(engine, metrics)
    assert engine.outputs.request_ids == [] and engine.outputs._seq_of == {}
    assert engine.get_stats().token_gaps == []


def test_finished_outputs_feed_ttft_e2e_and_queue_time():
    metrics = EngineMetrics("r0")
    timing = {"arrival_time": 0.0, "first_scheduled_time": 0.05, "first_token_time": 0.1, "finished_time": 0.4}
    done = RequestOutput("s", None, [], [CompletionOutput(0, "x", [7])], True, metrics=timing)
    running = RequestOutput("t", None, [], [CompletionOutput(0, "x", [7])], False)
    metrics.observe_step(EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, {}, token_gaps=[0.25, 0.5]), [done, running])
    assert metrics.ttft._sum.get() == pytest.approx(0.1) and metrics.e2e._sum.get() == pytest.approx(0.4)
    assert metrics.queue_time._sum.get() == pytest.approx(0.05)
    assert metrics.itl.sample("sum") == pytest.approx(0.75) and metrics.itl.sample("count") == 2


def test_a_steps_gaps_land_in_the_buckets_prometheus_client_would_put_them_in():
    """The inter-token gaps, observed a step at a time (`StepHistogram.observe_many`), expose what
    prometheus-client's `Histogram` gives for the same values one by one: every bucket's count (a gap equal to a
    bound in that bucket), the count and the sum, under the same names and labels."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from workers.metrics import _ITL_BUCKETS

    rng = random.Random(0)
    steps = [[rng.choice([rng.random() * 0.3, rng.expovariate(20), *_ITL_BUCKETS, 9.0]) for _ in range(n)]
             for n in (256, 0, 1, 37)]
    metrics = EngineMetrics("r0")
    reference = CollectorRegistry()
    want = Histogram("kvrelay:inter_token_latency_seconds", "Gap between successive tokens of a sequence.",
                     ["replica"], buckets=_ITL_BUCKETS, registry=reference).labels("r0")
    for gaps in steps:
        metrics.observe_step(EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, {}, token_gaps=gaps), [])
        for gap in gaps:
            want.observe(gap)

    def itl_lines(registry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "inter_token_latency" in line]

    got, expected = itl_lines(metrics.registry), itl_lines(reference)
    assert len(got) == len(_ITL_BUCKETS) + 5  # help, type, the buckets and +Inf, count, sum
    sums = [line for line in got if "_sum" in line], [line for line in expected if "_sum" in line]
    assert [line for line in got if "_sum" not in line] == [line for line in expected if "_sum" not in line]
    assert float(sums[0][0].split()[-1]) == pytest.approx(float(sums[1][0].split()[-1]))
    assert metrics.itl.sample("count") == sum(len(g) for g in steps)
