"""The compiled bfloat16 GEMV (`kernels/csrc_gemv_bf16.cpp`) and `CppLayerOps.linear`, which runs it for a
few contiguous bfloat16 rows and `F.linear` otherwise. Float32 sums in another order than oneDNN's: against a float64
reference each output is its correctly rounded value or one bfloat16 step from it; where every partial
sum is exact in float32 (small integers) it equals the reference bit for bit. The module skips where the
compiled kernels do not build; the kernel's own tests skip on CPUs without AVX512-BF16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_kernels import COMPILED, SKIP_REASON, took_torch_linear, within_one_bf16_step
from kernels.layer_ops import GEMV_MAX_ROWS, CppLayerOps

if not COMPILED:
    pytest.skip(SKIP_REASON, allow_module_level=True)
CPP = CppLayerOps()
needs_bf16 = pytest.mark.skipif(CPP._gemv is None, reason="the CPU lacks AVX512-BF16: the GEMV is not built")

# SmolLM2-135M's layers (qkv, o_proj, gate_up, down, LM head), then odd widths: K not a multiple of 32
# (the masked tail), K under one vector, N not a multiple of the 4-row tile.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (7, 33), (130, 1), (5, 100), (1001, 4095)]


def _data(m: int, n: int, k: int, seed: int, integers: bool = False):
    gen = torch.Generator().manual_seed(seed)
    if integers:
        x, w, b = (torch.randint(-8, 9, size, generator=gen).to(torch.bfloat16) for size in ((m, k), (n, k), (n,)))
    else:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
        b = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, w, b


def _reference(x, w, b, rounded: bool = True):
    """Float64 sums of the exact products (bfloat16 products are exact), by default rounded once to bfloat16."""
    y = x.double() @ w.double().T
    y = y if b is None else y + b.double()
    return y.to(torch.bfloat16) if rounded else y


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_a_float64_reference(n, k, bias):
    for m in (1, 2, 3, 4, 5, 8, 13, GEMV_MAX_ROWS):
        x, w, b = _data(m, n, k, seed=n * k + m)
        b = b if bias else None
        y = CPP._gemv(x, w, b)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n) and y.is_contiguous()
        within_one_bf16_step(y, x, w, b)
        torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-2, rtol=2 ** -7)


@needs_bf16
@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536), (1001, 4095), (5, 100)])
def test_exact_where_float32_sums_are_exact(n, k):
    """Integers up to 8 in magnitude: every product and partial sum is an integer below 2**24, so any
    order of float32 sums is exact, and the one rounding to bfloat16 must match the reference's."""
    for m in (*range(1, 9), 13, GEMV_MAX_ROWS):
        x, w, b = _data(m, n, k, seed=m, integers=True)
        assert torch.equal(CPP._gemv(x, w, b), _reference(x, w, b))
        assert torch.equal(CPP._gemv(x, w), _reference(x, w, None))


@needs_bf16
@pytest.mark.parametrize("n", [1, 5, 511, 1024, 1027, 2053])
def test_the_same_outputs_however_the_rows_are_split(n):
    """A thread reads its rows as four streams side by side and the few left over one at a time; which
    rows go together depends on N and the thread count, and must change no output: each equals the row
    computed alone, with one thread or two."""
    x, w, b = _data(5, n, 64, seed=n)
    alone = torch.cat([CPP._gemv(x, w[i:i + 1], b[i:i + 1]) for i in range(n)], dim=1)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(CPP._gemv(x, w, b), alone)
            assert torch.equal(CPP._gemv(x[:1], w, b), alone[:1])
    finally:
        torch.set_num_threads(threads)


@needs_bf16
def test_rows_of_a_wider_tensor_and_empty_inputs():
    x, w, b = _data(3, 64, 96, seed=3)
    wide = torch.zeros(3, 200, dtype=torch.bfloat16)
    wide[:, 10:106] = x
    assert torch.equal(CPP._gemv(wide[:, 10:106], w, b), CPP._gemv(x, w, b))
    assert CPP._gemv(x[:0], w).shape == (0, 64)


@needs_bf16
def test_bad_inputs_raise():
    x, w, b = _data(2, 16, 32, seed=0)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and W \\[N, K\\]"):
        CPP._gemv(x, w[:, :16].contiguous())
    with pytest.raises(RuntimeError, match="bfloat16"):
        CPP._gemv(x.float(), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        CPP._gemv(x, w.t().contiguous().t())
    with pytest.raises(RuntimeError, match="bias"):
        CPP._gemv(x, w, b[:8])


@needs_bf16
def test_linear_takes_the_gemv_for_few_contiguous_bfloat16_rows():
    limit = CPP.gemv_max_rows  # GEMV_MAX_ROWS, or fewer on a CPU with AMX
    x, w, b = _data(limit + 1, 96, 64, seed=5)
    for rows in (1, limit):
        assert not took_torch_linear(lambda: CPP.linear(x[:rows], w, b))
        assert not took_torch_linear(lambda: CPP.linear(x[:rows], w))
        within_one_bf16_step(CPP.linear(x[:rows], w, b), x[:rows], w, b)
    strided_w = w.t().contiguous().t()
    for args in [(x, w, b), (x[:2, ::2], w[:, :32].contiguous(), b), (x[:1], strided_w, b),
                 (x[:1].half(), w.half(), b.half())]:
        assert took_torch_linear(lambda: CPP.linear(*args))
    assert torch.equal(CPP.linear(x, w, b), F.linear(x, w, b))  # past the threshold: oneDNN
    assert torch.equal(CPP.linear(x[:1], strided_w, b), F.linear(x[:1], strided_w, b))
    assert not took_torch_linear(lambda: CppLayerOps(gemv_max_rows=limit + 1).linear(x, w, b))


def test_linear_falls_back_to_torch_for_other_dtypes():
    """(float32 at a few rows takes the float32 GEMV: tests/kernels/test_gemv_f32.py)"""
    for dtype in (torch.float16, torch.float64):
        x, w, b = (t.to(dtype) for t in _data(1, 40, 24, seed=7))
        assert torch.equal(CPP.linear(x, w, b), F.linear(x, w, b))
        assert CPP.linear(x, w, b).dtype == dtype


# The VNNI layout (`pack_vnni_bf16`): N a multiple of 16, K even.
VNNI_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (16, 2), (48, 34), (32, 4094)]


@needs_bf16
def test_vnni_layout():
    """[N/16, K/2, 16, 2]: block b, column pair q, row 16b + j, column 2q + t."""
    w = torch.arange(48 * 6, dtype=torch.float32).view(48, 6).to(torch.bfloat16)
    p = CPP._ext.pack_vnni_bf16(w)
    assert p.shape == (3, 3, 16, 2) and p.is_contiguous()
    assert torch.equal(p, w.view(3, 16, 3, 2).permute(0, 2, 1, 3))


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", VNNI_SHAPES)
def test_vnni_matches_a_float64_reference(n, k, bias):
    """Every row count up to the GEMV's (tiles of 8 rows and their remainders), each output within a step of
    the exact value; and integers, where the sums are exact, bit for bit. The LM head's shape (tiled as any
    other, but 50x the float64 work) at fewer row counts."""
    for m in (*range(1, 18), 23, GEMV_MAX_ROWS) if n * k < 1 << 22 else (1, 8, 11, GEMV_MAX_ROWS):
        x, w, b = _data(m, n, k, seed=n + k + m)
        b = b if bias else None
        p = CPP._ext.pack_vnni_bf16(w)
        y = CPP._gemv(x, p, b)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n) and y.is_contiguous()
        within_one_bf16_step(y, x, w, b)
        xi, wi, bi = _data(m, n, k, seed=m, integers=True)
        assert torch.equal(CPP._gemv(xi, CPP._ext.pack_vnni_bf16(wi), bi if bias else None),
                           _reference(xi, wi, bi if bias else None))


@needs_bf16
@pytest.mark.parametrize("n", [16, 48, 160, 1024, 2064])
def test_vnni_the_same_outputs_however_the_blocks_are_split(n):
    """Threads split the blocks of 16 rows and read three side by side, the rest one at a time: each output
    equals its block computed alone, with one thread or two, and a row of x computed alone."""
    x, w, b = _data(11, n, 64, seed=n)
    p = CPP._ext.pack_vnni_bf16(w)
    alone = torch.cat([CPP._gemv(x, p[i:i + 1], b[16 * i:16 * i + 16]) for i in range(n // 16)], dim=1)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(CPP._gemv(x, p, b), alone)
            assert torch.equal(torch.cat([CPP._gemv(x[i:i + 1], p, b) for i in range(11)]), alone)
    finally:
        torch.set_num_threads(threads)


@needs_bf16
def test_vnni_strided_rows_and_bad_inputs():
    x, w, b = _data(3, 64, 96, seed=4)
    p = CPP._ext.pack_vnni_bf16(w)
    assert torch.equal(CPP._gemv(x.t().contiguous().t(), p, b), CPP._gemv(x, p, b))  # columns apart: copied
    wide = torch.zeros(3, 200, dtype=torch.bfloat16)
    wide[:, 10:106] = x
    assert torch.equal(CPP._gemv(wide[:, 10:106], p, b), CPP._gemv(x, p, b))
    assert CPP._gemv(x[:0], p).shape == (0, 64)
    with pytest.raises(RuntimeError, match="multiple of 16 and K even"):
        CPP._ext.pack_vnni_bf16(w[:40].contiguous())
    with pytest.raises(RuntimeError, match="multiple of 16 and K even"):
        CPP._ext.pack_vnni_bf16(torch.zeros(16, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        CPP._ext.pack_vnni_bf16(w.float())
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        CPP._gemv(x[:, :64].contiguous(), p)
    with pytest.raises(RuntimeError, match="bias"):
        CPP._gemv(x, p, b[:16])
    with pytest.raises(RuntimeError, match="at most 4 rows"):
        CPP._ext.linear_bf16(torch.zeros(5, 96, dtype=torch.bfloat16), p, None, 4)
