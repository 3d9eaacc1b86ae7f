"""The AMX linear layer (`kernels/csrc_amx_linear.cpp`) and where `CppLayerOps` runs it: decode steps of more rows
than the GEMV takes, up to `amx_max_rows`, over the VNNI copies that `prepack` makes. Float32 sums of each
pair's products in the order of k, one rounding to bfloat16: against a float64 reference each output is its
correctly rounded value or one step from it (as the GEMV's, `test_gemv_bf16.py`). The kernel's own tests skip
where the CPU or the OS has no AMX tiles; the routing tests run everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_kernels import COMPILED, SKIP_REASON, within_one_bf16_step
from kernels import layer_ops
from kernels.layer_ops import AMX_TILE_MAX_ROWS, CppLayerOps, linear_packed

if not COMPILED:
    pytest.skip(SKIP_REASON, allow_module_level=True)
CPP = CppLayerOps()
EXT = CPP._ext
needs_amx = pytest.mark.skipif(not EXT.has_amx_linear(), reason="no AMX tiles on this CPU or OS")

# SmolLM2-135M's layers (qkv, o_proj, gate_up, down, LM head), then one block of 16 rows and one tile of columns
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (16, 32), (48, 96)]


def _data(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, w, b


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_a_float64_reference(n, k, bias):
    # one row, a partial tile, whole tiles, one and two passes over each pair of weight blocks, and past them
    for m in (1, 9, 16, 17, 32, 33, 48, 100):
        x, w, b = _data(m, n, k, seed=n * k + m)
        b = b if bias else None
        y = EXT.amx_linear_bf16(x, EXT.pack_vnni_bf16(w), b)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        within_one_bf16_step(y, x, w, b)


@needs_amx
def test_exact_where_float32_sums_are():
    """Small integers: every partial sum is exact in float32, so the result is the exact one, bit for bit;
    zero rows give +0 and never -0 (no bias added as + 0)."""
    gen = torch.Generator().manual_seed(7)
    x, w = (torch.randint(-8, 9, size, generator=gen).to(torch.bfloat16) for size in ((37, 64), (80, 64)))
    want = (x.double() @ w.double().T).to(torch.bfloat16)
    assert torch.equal(EXT.amx_linear_bf16(x, EXT.pack_vnni_bf16(w)), want)
    x[3] = -0.0
    y = EXT.amx_linear_bf16(x, EXT.pack_vnni_bf16(-w))
    assert torch.equal(y[3].view(torch.int16), torch.zeros(80, dtype=torch.int16))


@needs_amx
def test_strided_rows_and_a_partial_tile_read_only_x():
    """x as a column slice of a wider tensor (rows farther apart than K): the same result as its contiguous
    copy, including the last partial tile, which is copied row by row (never past x's storage)."""
    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(21, 192, generator=gen).to(torch.bfloat16)
    w = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    p = EXT.pack_vnni_bf16(w)
    assert torch.equal(EXT.amx_linear_bf16(wide[:, :96], p), EXT.amx_linear_bf16(wide[:, :96].contiguous(), p))
    assert torch.equal(EXT.amx_linear_bf16(wide[:, 96:], p), EXT.amx_linear_bf16(wide[:, 96:].contiguous(), p))


@needs_amx
def test_onednn_is_unchanged_after_the_tiles_were_ours():
    """The kernel loads its own tile configuration in each thread and releases the tiles; oneDNN's AMX
    matmuls, which configure theirs, give the same bits before and after it ran in the same threads."""
    x, w, _ = _data(200, 960, 576, seed=9)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    before = linear_packed(x, packed, None)
    for m in (9, 40, 200):
        EXT.amx_linear_bf16(x[:m], EXT.pack_vnni_bf16(w))
        assert torch.equal(linear_packed(x, packed, None), before)
    assert torch.equal(before, F.linear(x, w))


@needs_amx
def test_bad_input_is_refused():
    w = EXT.pack_vnni_bf16(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        odd_k = EXT.pack_vnni_bf16(torch.randn(32, 48).to(torch.bfloat16))
        EXT.amx_linear_bf16(torch.randn(3, 48).to(torch.bfloat16), odd_k)
    with pytest.raises(RuntimeError, match="packed as"):
        EXT.amx_linear_bf16(torch.randn(3, 64).to(torch.bfloat16), torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed as"):
        EXT.amx_linear_bf16(torch.randn(3, 32).to(torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="bfloat16"):
        EXT.amx_linear_bf16(torch.randn(3, 64), w)
    with pytest.raises(RuntimeError, match="bias"):
        EXT.amx_linear_bf16(torch.randn(3, 64).to(torch.bfloat16), w, torch.randn(31).to(torch.bfloat16))
    assert EXT.amx_linear_bf16(torch.randn(0, 64).to(torch.bfloat16), w).shape == (0, 32)


def test_amx_rows_default_to_the_cpu_and_os():
    """`amx_max_rows` is AMX_TILE_MAX_ROWS where the kernel runs and 0 elsewhere, whatever was asked."""
    assert CPP.amx_max_rows == (AMX_TILE_MAX_ROWS if EXT.has_amx_linear() else 0)
    assert CppLayerOps(amx_max_rows=0).amx_max_rows == 0
    assert CppLayerOps(amx_max_rows=24).amx_max_rows == (24 if EXT.has_amx_linear() else 0)
    assert AMX_TILE_MAX_ROWS > layer_ops.AMX_VNNI_MAX_ROWS


@needs_amx
def test_linear_takes_the_kernel_between_the_gemv_and_onednn():
    """With prepack's copies: the GEMV up to `vnni_max_rows` rows, the AMX kernel over the VNNI copy up to
    `amx_max_rows` (bit for bit the kernel's result), oneDNN past it; a weight whose columns are not a
    multiple of 32 skips the kernel for oneDNN."""
    ops = CppLayerOps(gemv_max_rows=4, vnni_max_rows=8, amx_max_rows=40)
    gen = torch.Generator().manual_seed(10)
    w, odd = (torch.randn(64, k, generator=gen).to(torch.bfloat16) for k in (96, 80))
    b = torch.randn(64, generator=gen).to(torch.bfloat16)
    ops.prepack([w, odd])
    vnni = EXT.pack_vnni_bf16(w)
    calls = []
    real = ops._ext

    class Spy:
        def __getattr__(self, name):
            if name == "amx_linear_bf16":
                calls.append(name)
            return getattr(real, name)

    ops._ext = Spy()
    for rows, kernel in ((8, False), (9, True), (40, True), (41, False)):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        calls.clear()
        y = ops.linear(x, w, b)
        assert bool(calls) == kernel, rows
        if kernel:
            assert torch.equal(y, real.amx_linear_bf16(x, vnni, b))
        elif rows > 8:
            assert torch.equal(y, F.linear(x, w, b))
        calls.clear()
        xo = torch.randn(rows, 80, generator=gen).to(torch.bfloat16)
        want = F.linear(xo, odd) if rows > 8 else real.gemv_bf16(xo, EXT.pack_vnni_bf16(odd))
        assert torch.equal(ops.linear(xo, odd), want)
        assert not calls
