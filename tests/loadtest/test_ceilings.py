"""loadtest/ceilings.py: every ceiling is measured (on tiny shapes here, so the test takes a second), comes back
positive under the keys the rooflines and the report read, and survives the JSON round trip. No timing asserts."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.cpu_extension import load_extension, onednn_bf16
from loadtest.ceilings import FLAGS_OF_INTEREST, Ceilings, cpu_info, measure_ceilings
from loadtest.model_shape import ModelShape

TINY = ModelShape(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  vocab_size=100)
MATMULS = {"qkv", "o_proj", "gate_up", "down", "lm_head"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_ceiling_is_measured_and_positive(dtype: str) -> None:
    before = torch.get_num_threads()
    c = measure_ceilings(TINY, threads=1, dtype=dtype, rows=8, read_bytes=2**20, reference_size=64)
    assert torch.get_num_threads() == before
    assert (c.threads, c.dtype, c.rows, c.device) == (1, dtype, 8, "cpu")
    assert c.dtype_bytes == (4 if dtype == "float32" else 2)
    for per_shape in (c.matmul_gflops, c.matmul_gflops_median, c.gemv_gbs):
        assert set(per_shape) == MATMULS and all(v > 0 for v in per_shape.values())
    assert c.lm_head_gflops == c.matmul_gflops["lm_head"]
    # bfloat16 also times oneDNN's packed weights (what `prepack_weights` reads); the ceiling is the faster
    # (where oneDNN has a bfloat16 path: elsewhere it refuses to pack, and the reference runs in float32)
    native = onednn_bf16()
    assert set(c.matmul_gflops_packed) == (MATMULS if dtype == "bfloat16" and native else set())
    assert c.reference_dtype == ("bfloat16" if native else "float32")
    assert all(c.matmul_gflops[k] >= v > 0 for k, v in c.matmul_gflops_packed.items())
    # one row: the faster of F.linear and the engine's compiled GEMV for the dtype, where it was built (float32
    # everywhere; bfloat16 with AVX512-BF16)
    compiled = {"float32": "gemv_f32", "bfloat16": "gemv_bf16" if load_extension().has_avx512_bf16() else None}[dtype]
    assert set(c.gemv_kernels) == MATMULS and set(c.gemv_kernels.values()) <= {"F.linear", compiled}
    assert set(c.gemv_gbs_torch) == (MATMULS if compiled else set())
    assert all(c.gemv_gbs[k] >= v > 0 for k, v in c.gemv_gbs_torch.items())
    # the layers' rate is a FLOP-weighted mix of theirs, so it lies between the slowest and the fastest
    layer_rates = [c.matmul_gflops[m.name] for m in TINY.layer_matmuls]
    assert min(layer_rates) <= c.layer_gflops * (1 + 1e-9) and c.layer_gflops <= max(layer_rates) * (1 + 1e-9)
    for value in (c.gemv_forward_ms, c.gemv_tok_s, c.read_gbs, c.read_gbs_median, c.read_gbs_1_thread,
                  c.read_gbs_1_thread_median, c.reference_gflops, c.reference_gflops_1_thread, c.seconds):
        assert value > 0
    assert c.read_bytes == 2**20 and len(c.loadavg) == 3
    data = json.loads(json.dumps(c.to_json()))
    assert data["gemv_tok_s"] == pytest.approx(c.gemv_tok_s)
    assert Ceilings.from_json(data) == c


def test_cpu_info_names_the_cpu_and_the_bf16_flags() -> None:
    info = cpu_info()
    assert info.model_name and set(info.flags) == set(FLAGS_OF_INTEREST)
    assert all(isinstance(v, bool) for v in info.flags.values())


def test_bad_arguments_fail_clearly() -> None:
    with pytest.raises(ValueError, match="not 'int8'"):
        measure_ceilings(TINY, dtype="int8")
    with pytest.raises(ValueError, match="positive"):
        measure_ceilings(TINY, rows=0)


def test_the_report_names_the_gemv_kernels_it_measured() -> None:
    """The report's GEMV row says which compiled kernel the one-row ceiling took the faster of; a JSON from before
    the ceilings timed one (no `gemv_kernels`) reads as F.linear alone."""
    from loadtest.report import ceilings_text

    data = measure_ceilings(TINY, threads=1, dtype="float32", rows=8, read_bytes=2**20, reference_size=64).to_json()
    data["gemv_kernels"] = {"qkv": "gemv_f32", "lm_head": "F.linear"}
    assert "each layer its own weights, the faster of F.linear and gemv_f32 |" in ceilings_text(data)
    del data["gemv_kernels"], data["gemv_gbs_torch"]
    assert "each layer its own weights |" in ceilings_text(data)
