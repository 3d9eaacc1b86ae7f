"""The compiled float32 GEMV (`kernels/csrc_gemv_f32.cpp`) and `CppLayerOps.linear`, which runs it for up to
`f32_max_rows` float32 rows and `F.linear` past them. Its float32 sums run in another order than
`F.linear`'s: against a float64 reference each output is within the worst-case error of a float32 sum of its
K products; where every partial sum is exact in float32 (small integers) it equals the reference bit for bit.
The module skips where the compiled kernels do not build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_kernels import COMPILED, SKIP_REASON, took_torch_linear
from kernels.layer_ops import F32_GEMV_MAX_ROWS, CppLayerOps

if not COMPILED:
    pytest.skip(SKIP_REASON, allow_module_level=True)
CPP = CppLayerOps()
GEMV = CPP._ext.gemv_f32

# SmolLM2-135M's layers (qkv, o_proj, gate_up, down, LM head), then odd widths: K not a multiple of a vector
# (8 or 16 lanes: the ragged end), K under one vector, N not a multiple of a one-row tile (8 weight rows).
ROWS = [*range(1, 10), 16, 17, 48, 64]  # one to eight rows (their own tiles), groups of 8 and what is left
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (7, 33), (130, 1), (5, 100), (1001, 4095)]


def _data(m: int, n: int, k: int, seed: int, integers: bool = False):
    gen = torch.Generator().manual_seed(seed)
    if integers:
        return (torch.randint(-8, 9, size, generator=gen).float() for size in ((m, k), (n, k), (n,)))
    return torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * k ** -0.5, torch.randn(n, generator=gen)


def within_float32_sum_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Each output within the worst-case error of float32 sums of its K products and the bias, with the products'
    own roundings ((K + 2) * 2**-24 times the sum of their magnitudes), from the float64 result."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    magnitudes = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    assert ((y.double() - exact).abs() <= (x.shape[1] + 2) * 2.0 ** -24 * magnitudes).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_a_float64_reference(n, k, bias):
    for m in ROWS if n * k < 10 ** 7 else (1, 8, 17):  # the LM head's: float64 references take seconds
        x, w, b = _data(m, n, k, seed=n * k + m)
        b = b if bias else None
        y = GEMV(x, w, b)
        assert y.dtype == torch.float32 and y.shape == (m, n) and y.is_contiguous()
        within_float32_sum_error(y, x, w, b)
        torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536), (1001, 4095), (5, 100), (130, 1)])
def test_exact_where_float32_sums_are_exact(n, k):
    """Integers up to 8 in magnitude: every product and partial sum is an integer below 2**24, so any order of
    float32 sums gives the exact result."""
    for m in ROWS:
        x, w, b = _data(m, n, k, seed=m, integers=True)
        assert torch.equal(GEMV(x, w, b), (x.double() @ w.double().T + b.double()).float())
        assert torch.equal(GEMV(x, w), (x.double() @ w.double().T).float())


@pytest.mark.parametrize("n", [1, 5, 511, 1024, 1027, 2053])
def test_the_same_outputs_however_the_rows_are_split(n):
    """One row runs over tiles of 8 weight rows and the rest one at a time; a thread walks its range in blocks, and
    past 8 rows each group of 8 in turn. Which outputs go together depends on N, the row count and the thread
    count, and must change no output: each equals its weight row computed alone, with one thread or two (and
    each row equals itself computed alone: `test_a_row_gives_the_same_outputs_beside_any_others`)."""
    threads = torch.get_num_threads()
    try:
        for m in ROWS:
            x, w, b = _data(m, n, 64, seed=n + m)
            alone = torch.cat([GEMV(x, w[i:i + 1], b[i:i + 1]) for i in range(n)], dim=1)
            for t in (1, 2):
                torch.set_num_threads(t)
                assert torch.equal(GEMV(x, w, b), alone)
    finally:
        torch.set_num_threads(threads)


def test_a_row_gives_the_same_outputs_beside_any_others():
    """A decode row's logits do not depend on the batch it runs in (tiles of 1 to 8 rows, groups of 8)."""
    x, w, b = _data(64, 1027, 576, seed=11)
    alone = torch.cat([GEMV(x[i:i + 1], w, b) for i in range(64)])
    for m in ROWS:
        assert torch.equal(GEMV(x[:m], w, b), alone[:m])


def test_rows_of_a_wider_tensor_and_an_empty_weight():
    x, w, b = _data(3, 64, 96, seed=3)
    wide = torch.zeros(3, 200)
    wide[:, 10:106] = x
    assert torch.equal(GEMV(wide[:, 10:106], w, b), GEMV(x, w, b))
    assert GEMV(x, w[:0]).shape == (3, 0)


def test_bad_inputs_raise():
    x, w, b = _data(2, 16, 32, seed=0)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] with 1 to 64 rows"):
        GEMV(x, w[:, :16].contiguous())
    with pytest.raises(RuntimeError, match="float32"):
        GEMV(x.bfloat16(), w.bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        GEMV(x, w.t().contiguous().t())
    with pytest.raises(RuntimeError, match="bias"):
        GEMV(x, w, b[:8])
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        GEMV(torch.zeros(65, 32), w)
    with pytest.raises(RuntimeError, match="unit stride"):
        GEMV(torch.zeros(32, 2).t(), w)


def test_linear_takes_the_gemv_for_few_float32_rows():
    limit = CPP.f32_max_rows
    assert limit == F32_GEMV_MAX_ROWS
    x, w, b = _data(limit + 1, 96, 64, seed=5)
    for rows in (1, limit):
        assert not took_torch_linear(lambda: CPP.linear(x[:rows], w, b))
        assert not took_torch_linear(lambda: CPP.linear(x[:rows], w))
        within_float32_sum_error(CPP.linear(x[:rows], w, b), x[:rows], w, b)
    strided_w = w.t().contiguous().t()
    for args in [(x, w, b), (x[:1], strided_w, b), (x[:1].half(), w.half(), b.half()), (x[:1].double(), w.double())]:
        assert took_torch_linear(lambda: CPP.linear(*args))
    assert torch.equal(CPP.linear(x, w, b), F.linear(x, w, b))  # past the limit: torch
    assert torch.equal(CPP.linear(x[:1], strided_w, b), F.linear(x[:1], strided_w, b))
    off = CppLayerOps(f32_max_rows=0)
    assert took_torch_linear(lambda: off.linear(x[:1], w, b))
    assert torch.equal(off.linear(x[:1], w, b), F.linear(x[:1], w, b))
