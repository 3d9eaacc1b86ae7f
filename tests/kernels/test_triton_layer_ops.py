"""The Triton layer ops (one kernel each) against the torch ops they replace, on a GPU where there is one, else
on the CPU in Triton's interpreter: RMSNorm, the residual add with its norm, rotary embedding on a strided
view of the qkv rows, SiLU-and-multiply; float32 and bfloat16; 1 to 64 rows."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)", allow_module_level=True)

from kernels.layer_ops import TorchLayerOps  # noqa: E402
from kernels.triton_layer_ops import TritonLayerOps  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
# float32: the sum's order differs; bfloat16: a sum in another order can move a result across a rounding step
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
ROWS = [1, 3, 17, 64]
torch_ops, triton_ops = TorchLayerOps(), TritonLayerOps()


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 100])
def test_rms_norm_and_add_rms_norm_match_torch(dtype, rows, width):
    x = _randn(rows, width, dtype=dtype, seed=rows, scale=3.0)
    residual = _randn(rows, width, dtype=dtype, seed=rows + 1)
    weight = _randn(width, dtype=dtype, seed=2, scale=0.1) + 1
    got = triton_ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, torch_ops.rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])
    before = x.clone()
    total, normed = triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    want_total, want_normed = torch_ops.add_rms_norm(before, residual, weight, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(total, want_total)  # one add either way
    else:  # Triton's interpreter rounds to bfloat16 its own way (a GPU rounds to nearest, as torch does)
        torch.testing.assert_close(total, want_total, **TOLERANCE[dtype])
    torch.testing.assert_close(normed, want_normed, **TOLERANCE[dtype])
    assert not torch.equal(normed, total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_rope_on_a_strided_view_of_the_qkv_rows_matches_torch(dtype, rows):
    """SmolLM2's shape: 9 query and 3 KV heads of 64, rotated in place inside rows that also hold V; the
    positions out of order; V untouched."""
    nh, kvh, d, max_pos = 9, 3, 64, 300
    qkv = _randn(rows, (nh + 2 * kvh) * d, dtype=dtype, seed=rows)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.arange(max_pos).float()[:, None] * inv[None]] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    positions = torch.randperm(max_pos, generator=torch.Generator().manual_seed(rows))[:rows].to(DEVICE)
    want = qkv.clone()
    torch_ops.rope_(want[:, : (nh + kvh) * d].view(rows, nh + kvh, d), cos, sin, positions)
    got = qkv.clone()
    view = got[:, : (nh + kvh) * d].view(rows, nh + kvh, d)
    assert not view.is_contiguous() or rows == 1
    triton_ops.rope_(view, cos, sin, positions)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    assert torch.equal(got[:, (nh + kvh) * d:], qkv[:, (nh + kvh) * d:])
    assert not torch.equal(got, qkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("intermediate", [1536, 1000])
def test_silu_and_mul_matches_torch(dtype, rows, intermediate):
    gate_up = _randn(rows, 2 * intermediate, dtype=dtype, seed=rows, scale=4.0)
    got = triton_ops.silu_and_mul(gate_up)
    assert got.shape == (rows, intermediate) and got.dtype == dtype
    torch.testing.assert_close(got, torch_ops.silu_and_mul(gate_up), **TOLERANCE[dtype])


def test_zero_rows_and_bad_layouts():
    x = torch.empty(0, 576, device=DEVICE)
    w = torch.ones(576, device=DEVICE)
    assert triton_ops.rms_norm(x, w, 1e-5).shape == (0, 576)
    assert triton_ops.silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)
    table = torch.ones(8, 64, device=DEVICE)
    qk = torch.ones(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="unit stride"):
        triton_ops.rope_(qk, table, table.t().contiguous().t(), torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous positions"):
        triton_ops.rope_(qk, table, table, torch.arange(6, device=DEVICE)[::2])
