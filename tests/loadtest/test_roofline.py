"""loadtest/roofline.py and loadtest/model_shape.py: the roofline arithmetic on a hand-sized model and hand-made
ceilings, every number worked out in the comments."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.ceilings import Ceilings, CpuInfo
from loadtest.http_client import RequestResult
from loadtest.model_shape import ModelShape
from loadtest.roofline import (RunRooflines, compute_seconds, decode_bytes_per_token, decode_context, lengths_of_requests,
                               lengths_of_results, lockstep_bound, run_roofline, workload_flops)
from loadtest.workloads import BenchRequest

# qkv (2 + 2*1)*2 x 4 = 32, o_proj 4 x 4 = 16, gate_up 16 x 4 = 64, down 4 x 8 = 32: 144 per layer, 288 in all;
# LM head 10 x 4 = 40; K and V per position: 2 x 2 layers x 1 head x 2 = 8 elements
SHAPE = ModelShape(hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2,
                   vocab_size=10)
LENGTHS = [(3, 2), (1, 1)]  # 4 and 1 tokens through the layers, 3 output tokens


def ceilings(layer_gflops: float = 1e-6, lm_head_gflops: float = 1e-7, read_gbs: float = 7.0666667e-5,
             dtype: str = "bfloat16") -> Ceilings:
    return Ceilings(device="cpu", dtype=dtype, threads=2, rows=512, cpu=CpuInfo("test", {}), loadavg=(0.0, 0.0, 0.0),
                    matmul_gflops={}, matmul_gflops_median={}, layer_gflops=layer_gflops, lm_head_gflops=lm_head_gflops,
                    gemv_gbs={}, gemv_forward_ms=10.0, read_gbs=read_gbs, read_gbs_median=read_gbs,
                    read_gbs_1_thread=read_gbs, read_gbs_1_thread_median=read_gbs, read_bytes=1, reference_gflops=1.0,
                    reference_gflops_1_thread=1.0)


def test_model_shape_counts_the_fused_matmuls() -> None:
    assert [(m.name, m.out_features, m.in_features, m.per_token) for m in SHAPE.matmuls] == [
        ("qkv", 8, 4, 2), ("o_proj", 4, 4, 2), ("gate_up", 16, 4, 2), ("down", 4, 8, 2), ("lm_head", 10, 4, 1)]
    assert (SHAPE.layer_params, SHAPE.weight_params, SHAPE.kv_elements_per_position) == (288, 328, 8)


def test_model_shape_reads_a_config_folder(default_model_dir: str, tmp_path: Path) -> None:
    shape = ModelShape.from_folder(default_model_dir)  # SmolLM2-135M: 30 layers, 576 hidden, 9/3 heads of 64
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (30, 576, 9, 3, 64)
    assert shape.weight_params == 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576) + 49152 * 576
    with pytest.raises(ValueError, match="no config.json"):
        ModelShape.from_folder(tmp_path)
    with pytest.raises(ValueError, match="'hidden_size'"):
        ModelShape.from_config({"num_attention_heads": 4})


def test_workload_flops() -> None:
    f = workload_flops(SHAPE, LENGTHS)
    assert f.layers == 2 * 288 * 5
    assert f.lm_head == 2 * 40 * 3
    assert f.attention == 4 * 2 * 2 * 2 * (4 * 5 // 2 + 1)  # keys read: 1+2+3+4 and 1
    assert f.total == 2880 + 240 + 352


def test_compute_roofline_fraction() -> None:
    # least time: (2880 + 352) / 1000 + 240 / 100 = 5.632 s; the run took twice that
    r = run_roofline(SHAPE, ceilings(), LENGTHS, duration_s=11.264, median_tpot_ms=None, bound="compute")
    assert r.compute_seconds == pytest.approx(5.632)
    assert r.compute_fraction == pytest.approx(0.5) and r.fraction == r.compute_fraction
    assert r.achieved_gflops == pytest.approx(3472 / 11.264 / 1e9)
    assert r.decode_tok_s is None and r.decode_fraction is None


def test_decode_roofline_fraction() -> None:
    # context: (2 x (3 + 1) + 1 x (1 + 0.5)) / 3 = 9.5 / 3; bytes: (328 + 8 x 9.5 / 3) x 2 = 706.67, so a
    # bandwidth of 70,666.7 B/s allows 100 tok/s; 20 ms per token is 50 tok/s: half the roofline
    assert decode_context(LENGTHS) == pytest.approx(9.5 / 3)
    assert decode_bytes_per_token(SHAPE, 9.5 / 3, 2) == pytest.approx(2120 / 3)
    r = run_roofline(SHAPE, ceilings(), LENGTHS, duration_s=1.0, median_tpot_ms=20.0, bound="memory")
    assert r.decode_ceiling_tok_s == pytest.approx(100.0, rel=1e-6)
    assert r.decode_tok_s == pytest.approx(50.0) and r.decode_fraction == pytest.approx(0.5, rel=1e-6)
    assert r.fraction == r.decode_fraction and r.to_json()["fraction"] == r.fraction
    f32 = run_roofline(SHAPE, ceilings(dtype="float32"), LENGTHS, 1.0, 20.0, "memory")
    assert f32.bytes_per_token == pytest.approx(2 * r.bytes_per_token)


def test_lockstep_bound() -> None:
    # prefill: layers 2 x 288 x (3 + 1) = 2304 and attention 32 x (1+2+3 + 1) = 224 FLOPs at 1000 FLOP/s, LM head
    # 2 x 40 x 2 = 160 at 100: 4.128 s. One decode step (j = 1, the first request only, 4 keys): FLOPs
    # (576 + 32 x 4) / 1000 + 80 / 100 = 1.504 s; reads (328 + 8 x 4) x 2 = 720 B, at 72 B/s 10 s
    slow = ceilings(read_gbs=72e-9)
    b = lockstep_bound(SHAPE, slow, LENGTHS)
    assert b.prefill_seconds == pytest.approx(4.128) and b.decode_steps == 1
    assert b.decode_compute_seconds == pytest.approx(1.504) and b.decode_memory_seconds == pytest.approx(10.0)
    assert b.decode_seconds == b.decode_memory_seconds and b.seconds == pytest.approx(14.128)
    # counted step by step, the FLOPs are the compute roofline's
    assert b.prefill_seconds + b.decode_compute_seconds == pytest.approx(compute_seconds(workload_flops(SHAPE, LENGTHS),
                                                                                            slow))
    # with bandwidth to spare (70,667 B/s) every step is bound by its FLOPs: the compute roofline's least time
    assert lockstep_bound(SHAPE, ceilings(), LENGTHS).seconds == pytest.approx(5.632)
    # steps run while any request has outputs left: 5 outputs give steps 1-4, with 2, 2, 1, 1 requests
    many = lockstep_bound(SHAPE, slow, [(1, 3), (2, 5), (4, 1), (1, 0)])
    assert many.decode_steps == 4
    keys = (1 + 1) + (2 + 1), (1 + 2) + (2 + 2), 2 + 3, 2 + 4
    assert many.decode_memory_seconds == pytest.approx(sum((328 + 8 * k) * 2 for k in keys) / 72)
    assert lockstep_bound(SHAPE, slow, [(3, 0)]).seconds == 0.0


def test_run_roofline_reports_the_lockstep_bound() -> None:
    # the lockstep engine: 14.128 s (above); the compute roofline 5.632 s; the run took twice the lockstep time
    r = run_roofline(SHAPE, ceilings(read_gbs=72e-9), LENGTHS, duration_s=28.256, median_tpot_ms=None, bound="compute")
    assert r.lockstep_seconds == pytest.approx(14.128) and r.lockstep_fraction == pytest.approx(0.5)
    assert r.attainable_compute_fraction == pytest.approx(5.632 / 14.128)
    assert r.lockstep_decode_memory_seconds == pytest.approx(10.0)
    assert r.to_json()["attainable_compute_fraction"] == r.attainable_compute_fraction


def test_run_roofline_rejects_an_unknown_bound() -> None:
    with pytest.raises(ValueError, match="bound"):
        run_roofline(SHAPE, ceilings(), LENGTHS, 1.0, None, "network")


def test_annotate_judges_each_workload_by_its_bound() -> None:
    rooflines = RunRooflines(SHAPE, ceilings())
    timed = {"workload": "poisson", "metrics": {"duration": 11.264, "median_tpot_ms": 20.0}, "samples": {"ttft": [0.1]}}
    rooflines.annotate(timed, LENGTHS)
    assert timed["roofline"]["bound"] == "memory" and timed["roofline"]["fraction"] == pytest.approx(0.5, rel=1e-6)
    assert timed["roofline"]["compute_fraction"] == pytest.approx(0.5)
    offline = {"workload": "burst", "metrics": {"duration": 11.264}, "samples": {}}
    rooflines.annotate(offline, LENGTHS)
    assert offline["roofline"]["bound"] == "compute" and offline["roofline"]["decode_fraction"] is None
    unstreamed = {"workload": "single", "metrics": {"duration": 1.0, "median_tpot_ms": 0.0}, "samples": {"ttft": []}}
    assert rooflines.annotate(unstreamed, LENGTHS)["roofline"]["fraction"] is None


def test_lengths_come_from_requests_or_from_the_requests_that_succeeded() -> None:
    assert lengths_of_requests([BenchRequest([1, 2, 3], 5), BenchRequest([4], 1)]) == [(3, 5), (1, 1)]
    results = [RequestResult(success=True, prompt_tokens=3, output_tokens=5),
               RequestResult(success=False, prompt_tokens=9, output_tokens=2)]
    assert lengths_of_results(results) == [(3, 5)]


def test_whole_answers_leave_no_decode_rate_for_the_rooflines() -> None:
    """A non-streamed answer arrives at once: its TTFT is its latency and its TPOT ~0, not a decode rate."""
    from loadtest.metrics import summarize
    from loadtest.report import run_from_results

    def answered(streamed: bool) -> RequestResult:
        r = RequestResult(success=True, prompt_tokens=3, output_tokens=4, latency=0.401)  # read just after
        for t in (0.1, 0.2, 0.3, 0.4) if streamed else (0.4,):
            r.record_arrival(t)
        return r

    rooflines = RunRooflines(SHAPE, ceilings())
    for streamed in (True, False):
        results = [answered(streamed), answered(streamed)]
        run = run_from_results("server", "server", "burst", summarize(results, 1.0), results)
        decode = rooflines.annotate(run, LENGTHS)["roofline"]["decode_tok_s"]
        assert (decode == pytest.approx(10.0, rel=0.01)) if streamed else decode is None
