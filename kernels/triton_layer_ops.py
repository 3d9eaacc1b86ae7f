"""The layer ops of a decoder layer in Triton, one kernel each, for the model on a GPU.

`TorchLayerOps` builds RMSNorm, the residual add with its norm, rotary embedding and SiLU-and-multiply from
small torch ops: ~35 kernels a layer, ~1,070 a decode step of SmolLM2-135M's 30 layers. On an H200 a
batch-256 decode step's graph then kept the GPU busy ~3 ms, most of it in elementwise, reduction, gather and
copy kernels of 2-3 us each (docs/benchmarks.md, "GPU check"). Here each op is one kernel, one program per
token, which rounds as the torch version does: float32 inside, the model's dtype wherever torch rounds to it
(bfloat16 results may still differ by a rounding step: a sum's order, exp and rsqrt, a fused multiply-add;
float32 greedy tokens on an H200 matched the CPU's torch ops, docs/benchmarks.md). The kernels hold no host
state and read no device value on the host, so decode steps capture them in CUDA graphs; under
`TRITON_INTERPRET=1` they run on CPU tensors (tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import triton_linear
from kernels.layer_ops import TorchLayerOps
from kernels.triton_linear import pdl_start, small_ops_launch


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_res, stride_out, stride_sum, n, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Row `pid`: with a residual, `s = x + res` rounded to the dtype (written to `sum_ptr`); the norm of `s`
    (or of `x`) in float32, rounded, then times the weight and rounded again, as `TorchLayerOps.rms_norm`."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
    h = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    h = (h * r).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * h).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rotate_halves(x1, x2, cos, sin, dt: tl.constexpr):
    """`x1*cos - x2*sin` and `x2*cos + x1*sin` (float32 halves and tables), each product and the sum or
    difference rounded to `dt` as torch's ops round; returned in `dt`."""
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def rotate_in_place(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_xt, stride_xh, stride_table, num_heads,
                    HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    """Token `pid`, its first `num_heads` heads: `x1*cos - x2*sin` and `x2*cos + x1*sin` on the halves, each
    product and difference rounded to the dtype as torch's ops do, in place. Returns the rotated halves (in
    the dtype, [HEADS_P, HALF_P]) with their head and column indices and which columns are real."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS_P)
    cols = tl.arange(0, HALF_P)
    col_ok = cols < HALF
    ok = (heads[:, None] < num_heads) & col_ok[None, :]
    dt = x_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_table + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    first = x_ptr + t * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, cos, sin, dt)
    tl.store(first, o1, mask=ok)
    tl.store(first + HALF, o2, mask=ok)
    return o1, o2, heads, cols, col_ok


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_xt, stride_xh, stride_table, num_heads,
                 HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr, PDL: tl.constexpr = False):
    """Token `pid`, every head rotated in place (`rotate_in_place`)."""
    pdl_start(PDL)
    rotate_in_place(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_xt, stride_xh, stride_table, num_heads,
                    HALF, HEADS_P, HALF_P)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Row `pid(0)`, columns of block `pid(1)`: `silu(gate)` rounded to the dtype, times `up`, rounded."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (s * u).to(dt), mask=ok)


SILU_BLOCK = 1024


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as [rows, width] with unit stride along the width (a copy only if it has none)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`x + residual` in a new tensor, or `x` without a residual; the RMSNorm of that), in one kernel."""
    x2 = _rows(x)
    r2 = x2 if residual is None else _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    total = x2 if residual is None else torch.empty_like(out)
    n = x2.shape[-1]
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, total, x2.stride(0), r2.stride(0), out.stride(0),
                                         total.stride(0), n, eps, HAS_RES=residual is not None, BLOCK=block,
                                         num_warps=_norm_warps(block), **small_ops_launch(x.device))
    return total.view(x.shape), out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`x + residual` (into a new tensor) and its RMSNorm, in one kernel."""
    return _norm(x, residual, weight, eps)


def rope_(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate `x` ([tokens, heads, head_dim], any token and head strides, unit stride in head_dim) in place."""
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1 or cos_table.stride(-1) != 1 or sin_table.stride(-1) != 1 \
            or sin_table.stride(0) != cos_table.stride(0):
        raise ValueError("rope_ needs unit stride along head_dim in x and the tables, and tables of one layout")
    if positions.dim() != 1 or positions.stride(0) != 1:
        raise ValueError("rope_ needs contiguous positions, one per token")
    half = dim // 2
    if tokens:
        _rope_kernel[(tokens,)](x, cos_table, sin_table, positions, x.stride(0), x.stride(1), cos_table.stride(0),
                                heads, HALF=half, HEADS_P=triton.next_power_of_2(heads),
                                HALF_P=triton.next_power_of_2(half), **small_ops_launch(x.device))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g2 = _rows(gate_up)
    n = g2.shape[-1] // 2
    out = torch.empty(g2.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    if g2.shape[0]:
        _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(n, SILU_BLOCK))](g2, out, g2.stride(0), out.stride(0), n,
                                                                        BLOCK=SILU_BLOCK, num_warps=4,
                                                                        **small_ops_launch(gate_up.device))
    return out.view(*gate_up.shape[:-1], n)


class TritonLayerOps(TorchLayerOps):
    """`TorchLayerOps` with the norms, rotary embedding and SiLU-and-multiply as one Triton kernel each, and
    (under `triton_linear.NORM_LINEAR_CONFIG`, for steps of up to its `max_rows`) each norm fused with the
    matmul after it, and SiLU-and-multiply with the gate/up matmul (`kernels/triton_linear.py`). Other
    matmuls stay cuBLAS's unless the config's `plain_matmuls` says; layers run one by one."""

    name = "triton"

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """cuBLAS's (`F.linear`), or under a `NORM_LINEAR_CONFIG` with `plain_matmuls` the fused kernels' matmul
        for steps it takes, up to `PLAIN_MAX_OUT` outputs (not the LM head)."""
        config = triton_linear.NORM_LINEAR_CONFIG
        if (config is not None and config.plain_matmuls and weight.shape[0] <= triton_linear.PLAIN_MAX_OUT
                and triton_linear.fused_rows_ok(x, None, weight, config)):
            return triton_linear.linear(x, weight, bias, config)
        return F.linear(x, weight, bias)

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        config = triton_linear.NORM_LINEAR_CONFIG
        if triton_linear.fused_rows_ok(x, residual, weight, config):
            return triton_linear.norm_linear(x, residual, norm_weight, eps, weight, bias, config=config)
        return super().norm_linear(x, residual, norm_weight, eps, weight, bias)

    def norm_gate_up(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config = triton_linear.NORM_LINEAR_CONFIG
        if triton_linear.fused_rows_ok(x, residual, gate_up, config):
            return triton_linear.norm_linear(x, residual, norm_weight, eps, gate_up, gated=True, config=config)
        return super().norm_gate_up(x, residual, norm_weight, eps, gate_up)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def rope_(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor) -> None:
        rope_(x, cos_table, sin_table, positions)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
