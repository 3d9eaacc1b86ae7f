"""A decoder layer's RMSNorm (with the residual add before it) fused into the matmul after it, in Triton, for
the model on a GPU.

On an H200 a batch-256 decode step of SmolLM2-135M ran 309 kernels in 1.5 ms of device time
(docs/benchmarks.md, "First runs on an H200"): cuBLAS's four GEMMs a layer took 0.54 ms at 256 rows, where the
weights alone would stream in 0.07 ms, and the norms, rotary, store and SiLU kernels between them another 0.25
ms, 2-5 us each whatever their size. Here the residual add, the norm and the qkv projection are one kernel, and
so are the add, the norm, the gate/up projection and SiLU-and-multiply: a layer runs six kernels instead of nine
(five with the rotary embedding and the K/V store in the qkv kernel, `kernels/triton_kv_write.py`).

Each program computes a tile of output rows by output columns. It reads its rows twice: once for the
sum of squares (the norm's scale per row), once to normalise them tile by tile into the matmul, rounding
where `TritonLayerOps.add_rms_norm` rounds (the sum `x + residual` and the normalised rows in the model's
dtype), so the matmul's input is the unfused path's. The programs of the first column tile also write the sum,
the residual stream the layer goes on with. The matmul sums in float32 in its own order (cuBLAS's differs as
much); the gated variant rounds the gate and up columns, then SiLU, as `silu_and_mul` does.

Under `TRITON_INTERPRET=1` (tests on the CPU) the kernels run in Triton's interpreter, whose bfloat16 `tl.dot`
is wrong, so there (only) the dot products are computed in float32."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First in a kernel launched with programmatic dependent launch (`pdl_launch`; Hopper on): the next
    kernel's programs may start once every program of this one has (each then waits here in its own), and
    this one waits until the kernel before it has finished and its writes are visible. Called before any load
    or store, so a kernel overlaps its neighbours' launch and ramp, never their memory."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


_CAPABILITY: dict[torch.device, int] = {}


def pdl_launch(enabled: bool, device: torch.device) -> dict:
    """The launch arguments of a kernel that calls `pdl_start`: with programmatic dependent launch where
    `enabled` (a config's `pdl`) and the device has it (CUDA from sm_90; the meta device, where the ahead-of-time
    compile records launches), else without (Triton's interpreter, older GPUs)."""
    if not enabled or interpreting() or device.type not in ("cuda", "meta"):
        return {"PDL": False}
    if device.type == "cuda":
        if device not in _CAPABILITY:
            _CAPABILITY[device] = torch.cuda.get_device_capability(device)[0]
        if _CAPABILITY[device] < 9:
            return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


def dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST, DOT_PRECISION) for a kernel's `tl.dot` over `dtype`: float32 dots in full precision, not TF32;
    under the interpreter every dot in float32 (its bfloat16 `tl.dot` is wrong)."""
    upcast = interpreting() or dtype == torch.float32
    return upcast, "ieee" if upcast else "tf32"


# the pipeline stages that fit a variant whose launch at more found the GPU's shared memory too small
_FITTED_STAGES: dict[tuple, int] = {}


def launch_fitting(kernel, grid: tuple, *args, num_stages: int, **kwargs) -> None:
    """`kernel[grid](*args, num_stages=num_stages, **kwargs)`, with fewer software-pipeline stages where a
    variant needs more shared memory than the GPU gives a block (Triton raises `OutOfResources` before
    launching anything): in float32 the fused kernels' three stages take 107 KB, past the 99 KB of an sm_86/89
    GPU (A10, L4, L40S), and two take 58. The stages that fit are remembered per variant (its constexprs and
    warps, the first argument's dtype), so only a variant's first launch tries more."""
    from triton.runtime.errors import OutOfResources

    key = (kernel, getattr(args[0], "dtype", None), num_stages, tuple(sorted(kwargs.items())))
    stages = _FITTED_STAGES.get(key, num_stages)
    while True:
        try:
            kernel[grid](*args, num_stages=stages, **kwargs)
            return
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            _FITTED_STAGES[key] = stages


# Pipeline stages of `row_scale`'s loop, whose loads feed no `tl.dot`: Triton pipelines such a loop only when
# told to (`tl.range(num_stages=)`), and without it each of its tiles (9 of them at a hidden size of 576) waits
# a whole round trip before the next is loaded, every program, before its matmul starts. With 4, three tiles
# are in flight (compiled for sm_90: `cp.async` into three buffers; docs/results/pipeline-20261205/).
ROW_SCALE_STAGES = tl.constexpr(4)


@triton.jit
def row_scale(x_ptr, res_ptr, sum_ptr, rows, row_ok, K, stride_x, stride_res, stride_sum, eps, write_sum,
              HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The RMSNorm scale of each of `rows` (`rsqrt(mean(s^2) + eps)` of `s = x + res` rounded to the dtype, or
    of `x`), in float32; writes `s` to `sum_ptr` where `write_sum`."""
    dt = x_ptr.dtype.element_ty
    ks0 = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=ROW_SCALE_STAGES):
        ks = k0 + ks0
        ok = row_ok[:, None] & (ks < K)[None, :]
        s = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=ok, other=0.0)
        if HAS_RES:
            s = (s.to(tl.float32)
                 + tl.load(res_ptr + rows[:, None] * stride_res + ks[None, :], mask=ok, other=0.0).to(tl.float32))
            s = s.to(dt)
            tl.store(sum_ptr + rows[:, None] * stride_sum + ks[None, :], s, mask=ok & write_sum)
        sf = s.to(tl.float32)
        ss += tl.sum(sf * sf, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def normed_tile(x_ptr, res_ptr, nw_ptr, rows, row_ok, ks, k_ok, r, stride_x, stride_res, HAS_RES: tl.constexpr):
    """Columns `ks` of the normalised rows, rounded as `TritonLayerOps.add_rms_norm` rounds: `s` in the dtype,
    `s * r` in the dtype, times the norm's weight in the dtype."""
    dt = x_ptr.dtype.element_ty
    ok = row_ok[:, None] & k_ok[None, :]
    s = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=ok, other=0.0)
    if HAS_RES:
        s = (s.to(tl.float32)
             + tl.load(res_ptr + rows[:, None] * stride_res + ks[None, :], mask=ok, other=0.0).to(tl.float32))
        s = s.to(dt)
    h = (s.to(tl.float32) * r[:, None]).to(dt).to(tl.float32)
    nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    return (h * nw[None, :]).to(dt)


@triton.jit
def _norm_linear_kernel(x_ptr, res_ptr, sum_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                        stride_x, stride_res, stride_sum, stride_w, stride_out, eps,
                        HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, NORM: tl.constexpr = True,
                        PDL: tl.constexpr = False):
    """Rows `pid(0)`, output columns `pid(1)` of `rms_norm(x + res) @ w.T (+ b)`; GATED: of
    `silu(h @ w[:N].T) * (h @ w[N:].T)`. The column-0 programs write `x + res` to `sum_ptr`. Without NORM
    (and without a residual): `x @ w.T (+ b)`, a plain matmul."""
    pdl_start(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < M
    if NORM:
        r = row_scale(x_ptr, res_ptr, sum_ptr, rows, row_ok, K, stride_x, stride_res, stride_sum, eps, pid_n == 0,
                      HAS_RES, BLOCK_M, BLOCK_K)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        if NORM:
            h = normed_tile(x_ptr, res_ptr, nw_ptr, rows, row_ok, ks, k_ok, r, stride_x, stride_res, HAS_RES)
        else:
            h = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=w_ok, other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            u = tl.load(w_ptr + (cols[None, :] + N) * stride_w + ks[:, None], mask=w_ok, other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
            acc_up = tl.dot(h, u, acc_up, input_precision=DOT_PRECISION)
    if GATED:
        g = acc.to(dt).to(tl.float32)
        g = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (g * acc_up.to(dt).to(tl.float32)).to(dt)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dt)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """How the fused norm-and-matmul kernels launch: rows and columns of output per program (`block_m` is the
    most rows: steps of fewer rows take the power of two at or above their count, at least 16, `tl.dot`'s
    minimum), the reduction's tile, Triton's warps and pipeline stages; the most rows a step may have for
    the fused kernels (past it, prefill chunks: the norm kernel, then cuBLAS); and whether the layers' other
    matmuls run in this kernel too (`linear`; the LM head, vocabulary-wide, stays cuBLAS's)."""

    block_m: int = 32
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    max_rows: int = 512
    # the layers' other matmuls (o_proj, down) in the same kernel too, unnormalised, instead of cuBLAS's
    plain_matmuls: bool = False
    # programmatic dependent launch (`pdl_launch`): each kernel's programs start while the one before ends
    pdl: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1) or (name != "num_warps" and value < 16):
                raise ValueError(f"{name} must be a power of two (block sizes at least 16), got {value}")
        if self.num_stages < 1 or self.max_rows < 0:
            raise ValueError(f"num_stages must be positive and max_rows not negative, got {self.num_stages}, "
                             f"{self.max_rows}")

    def rows_per_program(self, rows: int) -> int:
        return min(self.block_m, max(16, triton.next_power_of_2(max(rows, 1))))


# Read at every call (the GPU check's `linear_sweep` times others and may set the fastest, or None, for its
# run). None (the default): the layers run the norm kernel and cuBLAS's matmul apart. On an H100
# (docs/benchmarks.md, 2026-12-05) a batch-256 step's layers but attention took 808 us that way, 901 with the
# fastest fused config and 943 with `LinearConfig()`; at one row 709 against 733.
NORM_LINEAR_CONFIG: LinearConfig | None = None
# programmatic dependent launch (`pdl_launch`) for the layers' small kernels beside cuBLAS's matmuls: the norms,
# rotary with the K/V store, SiLU-and-mul (`triton_layer_ops`, `triton_kv_write.rope_store_kv` and `store_kv`).
# Off until a GPU has timed it: the GPU check's linear sweep times the layers both ways and sets it for its later
# sections where it wins by `PDL_GAIN`
SMALL_OPS_PDL = False


def small_ops_launch(device: torch.device) -> dict:
    """A small layer kernel's launch arguments: with programmatic dependent launch where `SMALL_OPS_PDL` says and
    the device has it (`pdl_launch`)."""
    return pdl_launch(SMALL_OPS_PDL, device)


def resolve_config(config: LinearConfig | None) -> LinearConfig:
    """`config`, else `NORM_LINEAR_CONFIG`, else the default: what a direct call of the fused kernels launches with."""
    return config or NORM_LINEAR_CONFIG or LinearConfig()


def fused_rows_ok(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  config: LinearConfig | None) -> bool:
    """Whether `TritonLayerOps` runs `norm_linear` on a step of `x`'s rows under `config`: some rows, at most
    `max_rows`, in the weight's dtype and on its device, with unit stride along the reduction."""
    return (config is not None and x.dim() == 2 and 0 < x.shape[0] <= config.max_rows and x.stride(1) == 1
            and x.dtype == weight.dtype and x.device == weight.device and weight.dim() == 2
            and weight.stride(1) == 1 and x.shape[1] == weight.shape[1]
            and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1
                                      and residual.dtype == x.dtype)))


# `TritonLayerOps.linear` leaves matmuls wider than this to cuBLAS: the LM head (a vocabulary wide), which the
# GPU check's sweep does not time
PLAIN_MAX_OUT = 16384


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: LinearConfig | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` ([rows, in] with unit stride along `in`) in the fused kernels' matmul, float32 sums
    rounded once. `config`: `NORM_LINEAR_CONFIG`, else the default."""
    config = resolve_config(config)
    if x.dim() != 2 or x.stride(1) != 1 or weight.dim() != 2 or weight.stride(1) != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"linear needs [rows, in] inputs and an [out, in] weight with unit stride along in, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m = config.rows_per_program(m)
        upcast, precision = dot_mode(x.dtype)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, config.block_n))
        launch_fitting(
            _norm_linear_kernel, grid, x, x, x, x, weight, weight if bias is None else bias, out, m, n, k,
            x.stride(0), x.stride(0), x.stride(0), weight.stride(0), out.stride(0), 0.0,
            HAS_RES=False, HAS_BIAS=bias is not None, GATED=False, BLOCK_M=block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, UPCAST=upcast, DOT_PRECISION=precision, NORM=False,
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(config.pdl, x.device),
        )
    return out


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                config: LinearConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(`x + residual` in a new tensor, or `x` itself without a residual; `rms_norm(that) @ weight.T + bias`),
    or with `gated` (`weight` is gate and up stacked, no bias) `silu(h @ gate.T) * (h @ up.T)`, in one kernel.
    `x` and `residual` are [rows, hidden] with unit stride along hidden. `config`: `NORM_LINEAR_CONFIG`, else
    the default."""
    config = resolve_config(config)
    if x.dim() != 2 or x.stride(1) != 1 or (
            residual is not None and (residual.shape != x.shape or residual.stride(1) != 1)):
        raise ValueError("norm_linear needs [rows, hidden] inputs with unit stride along hidden")
    if weight.dim() != 2 or weight.stride(1) != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"norm_linear needs a [out, {x.shape[1]}] weight with unit stride along its rows, "
                         f"got {tuple(weight.shape)}")
    if gated and (bias is not None or weight.shape[0] % 2):
        raise ValueError("gated norm_linear takes gate and up stacked (an even number of rows) and no bias")
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty_like(x)
    if m:
        block_m = config.rows_per_program(m)
        upcast, precision = dot_mode(x.dtype)
        res = x if residual is None else residual
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, config.block_n))
        launch_fitting(
            _norm_linear_kernel, grid,
            x, res, total, norm_weight, weight, weight if bias is None else bias, out, m, n, k,
            x.stride(0), res.stride(0), total.stride(0), weight.stride(0), out.stride(0), eps,
            HAS_RES=residual is not None, HAS_BIAS=bias is not None, GATED=gated,
            BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            UPCAST=upcast, DOT_PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages,
            **pdl_launch(config.pdl, x.device),
        )
    return total, out
