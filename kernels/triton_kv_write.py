"""Writing a step's keys and values into the paged KV cache, in Triton: alone (`store_kv`), after rotating the
step's queries and keys (`rope_store_kv`: one launch a layer fewer than rotary then store), or as the whole
layer input (`norm_qkv_rope_store`: residual add, RMSNorm, qkv projection, rotary and store in one kernel). The
caches are [blocks, block_size, kv_heads, head_dim]; a token's slot is `block * block_size + offset`, and a
negative slot (a padding row of a captured graph) writes nowhere. `TritonPagedAttention`
(`kernels/triton_attention.py`) launches them. Under `TRITON_INTERPRET=1` they run in Triton's interpreter
(tests on the CPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_linear
from kernels.triton_layer_ops import rotate_halves, rotate_in_place
from kernels.triton_linear import (dot_mode, launch_fitting, normed_tile, pdl_launch, pdl_start, row_scale,
                                   small_ops_launch)


def fusable_head_dim(head_dim: int) -> bool:
    """Whether `norm_qkv_rope_store` takes heads of `head_dim`: a power of two of at least 32 (each half one
    `tl.dot` of at least 16 columns)."""
    return head_dim >= 32 and not head_dim & (head_dim - 1)


@triton.jit
def _store_kv_kernel(key, value, k_cache, v_cache, slot_mapping, stride_kt, stride_vt, block_size,
                     stride_kb, stride_ks, stride_vb, stride_vs, ROW: tl.constexpr, ROW_P: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, ROW_P)
    ok = cols < ROW
    block, offset = slot // block_size, slot % block_size
    k = tl.load(key + t * stride_kt + cols, mask=ok)
    v = tl.load(value + t * stride_vt + cols, mask=ok)
    tl.store(k_cache + block * stride_kb + offset * stride_ks + cols, k, mask=ok)
    tl.store(v_cache + block * stride_vb + offset * stride_vs + cols, v, mask=ok)


@triton.jit
def _rope_store_kv_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_mapping, k_cache, v_cache,
                          stride_qt, stride_qh, stride_vt, stride_vh_in, stride_table, num_heads, num_kv_heads,
                          block_size, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr, KV_P: tl.constexpr,
                          DIM_P: tl.constexpr, PDL: tl.constexpr = False):
    """Token `pid`: its query and key heads rotated in place (`triton_layer_ops.rotate_in_place`), then its
    rotated keys and its values stored into its slot, unless the slot is negative."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    o1, o2, heads, cols, col_ok = rotate_in_place(qk_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh,
                                                  stride_table, num_heads + num_kv_heads, HALF, HEADS_P, HALF_P)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:
        block, offset = slot // block_size, slot % block_size
        is_key = (heads >= num_heads) & (heads < num_heads + num_kv_heads)
        kv_head = tl.where(is_key, heads - num_heads, 0)
        key_ok = is_key[:, None] & col_ok[None, :]
        dst = k_cache + block * stride_kb + offset * stride_ks + kv_head[:, None] * stride_kh + cols[None, :]
        tl.store(dst, o1.to(k_cache.dtype.element_ty), mask=key_ok)
        tl.store(dst + HALF, o2.to(k_cache.dtype.element_ty), mask=key_ok)
        vh = tl.arange(0, KV_P)
        vc = tl.arange(0, DIM_P)
        v_ok = (vh[:, None] < num_kv_heads) & (vc[None, :] < 2 * HALF)
        v = tl.load(v_ptr + t * stride_vt + vh[:, None] * stride_vh_in + vc[None, :], mask=v_ok)
        tl.store(v_cache + block * stride_vb + offset * stride_vs + vh[:, None] * stride_vh + vc[None, :],
                 v.to(v_cache.dtype.element_ty), mask=v_ok)


@triton.jit
def _norm_qkv_rope_store_kernel(x_ptr, res_ptr, sum_ptr, nw_ptr, w_ptr, b_ptr, q_ptr, cos_ptr, sin_ptr, pos_ptr,
                                slot_mapping, k_cache, v_cache, M, K, num_heads, num_kv_heads, stride_x, stride_res,
                                stride_sum, stride_w, stride_qt, stride_qh, stride_table, block_size, stride_kb,
                                stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, eps,
                                HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                                DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """Rows `pid(0)`, head `pid(1)` (queries, then keys, then values) of a layer's input: the residual add and
    RMSNorm (`triton_linear.row_scale`, `normed_tile`), the head's two halves of the qkv projection, rounded to
    the dtype; queries and keys rotated (`rotate_halves`, as `rotate_in_place`); queries written to `q_ptr`, keys and
    values stored into their slots (negative slots skipped). The head-0 programs write `x + res`."""
    pdl_start(PDL)
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < M
    r = row_scale(x_ptr, res_ptr, sum_ptr, rows, row_ok, K, stride_x, stride_res, stride_sum, eps, head == 0,
                  HAS_RES, BLOCK_M, BLOCK_K)
    cols = tl.arange(0, HALF)
    first = (head * 2 * HALF + cols).to(tl.int64)  # the head's weight rows, first half
    acc1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        h = normed_tile(x_ptr, res_ptr, nw_ptr, rows, row_ok, ks, k_ok, r, stride_x, stride_res, HAS_RES)
        w1 = tl.load(w_ptr + first[None, :] * stride_w + ks[:, None], mask=k_ok[:, None], other=0.0)
        w2 = tl.load(w_ptr + (first[None, :] + HALF) * stride_w + ks[:, None], mask=k_ok[:, None], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w1 = w1.to(tl.float32)
            w2 = w2.to(tl.float32)
        acc1 = tl.dot(h, w1, acc1, input_precision=DOT_PRECISION)
        acc2 = tl.dot(h, w2, acc2, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + first).to(tl.float32)[None, :]
        acc2 += tl.load(b_ptr + first + HALF).to(tl.float32)[None, :]
    x1 = acc1.to(dt).to(tl.float32)
    x2 = acc2.to(dt).to(tl.float32)
    if head < num_heads + num_kv_heads:  # a query or key head: rotated
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        table = pos[:, None] * stride_table + cols[None, :]
        cos = tl.load(cos_ptr + table, mask=row_ok[:, None], other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + table, mask=row_ok[:, None], other=0.0).to(tl.float32)
        o1, o2 = rotate_halves(x1, x2, cos, sin, dt)
    else:
        o1 = x1.to(dt)
        o2 = x2.to(dt)
    if head < num_heads:
        dst = q_ptr + rows[:, None] * stride_qt + head * stride_qh + cols[None, :]
        tl.store(dst, o1, mask=row_ok[:, None])
        tl.store(dst + HALF, o2, mask=row_ok[:, None])
    else:
        slot = tl.load(slot_mapping + rows, mask=row_ok, other=-1).to(tl.int64)
        ok = (slot >= 0)[:, None]
        block = tl.where(slot >= 0, slot, 0) // block_size
        offset = tl.where(slot >= 0, slot, 0) % block_size
        if head < num_heads + num_kv_heads:
            dst = k_cache + block[:, None] * stride_kb + offset[:, None] * stride_ks \
                + (head - num_heads) * stride_kh + cols[None, :]
        else:
            dst = v_cache + block[:, None] * stride_vb + offset[:, None] * stride_vs \
                + (head - num_heads - num_kv_heads) * stride_vh + cols[None, :]
        tl.store(dst, o1.to(k_cache.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, o2.to(k_cache.dtype.element_ty), mask=ok)


def rope_store_kv(qk: torch.Tensor, value: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                  positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Rotate `qk` ([tokens, heads + kv_heads, head_dim], the keys last) in place and store its keys and
    `value` ([tokens, kv_heads, head_dim]) into their slots, negative slots skipped: `rope_` then `store_kv`
    in one kernel."""
    tokens, all_heads, dim = qk.shape
    num_kv_heads = value.shape[1]
    if qk.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 \
            or cos_table.stride(-1) != 1 or sin_table.stride(-1) != 1 or sin_table.stride(0) != cos_table.stride(0):
        raise ValueError("rope_store_kv needs unit stride along head_dim, and tables of one layout")
    if positions.dim() != 1 or positions.stride(0) != 1:
        raise ValueError("rope_store_kv needs contiguous positions, one per token")
    if tokens:
        _rope_store_kv_kernel[(tokens,)](
            qk, value, cos_table, sin_table, positions, slot_mapping, k_cache, v_cache,
            qk.stride(0), qk.stride(1), value.stride(0), value.stride(1), cos_table.stride(0),
            all_heads - num_kv_heads, num_kv_heads, k_cache.shape[1],
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), HALF=dim // 2, HEADS_P=triton.next_power_of_2(all_heads),
            HALF_P=triton.next_power_of_2(dim // 2), KV_P=triton.next_power_of_2(num_kv_heads),
            DIM_P=triton.next_power_of_2(dim), **small_ops_launch(qk.device))


def norm_qkv_rope_store(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int, num_kv_heads: int,
                        cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        config: triton_linear.LinearConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input in one kernel: (`x + residual` in a new tensor, or `x` without a residual; the queries,
    [rows, num_heads, head_dim]); the keys and values stored into their slots, negative slots skipped. As
    `norm_linear` then `rope_store_kv`, the same roundings. `config`: `NORM_LINEAR_CONFIG`, else the default
    (its `block_k` and tile height; a program computes one head)."""
    config = triton_linear.resolve_config(config)
    m, k = x.shape
    head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)
    if (x.stride(1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(1) != 1))
            or weight.shape != ((num_heads + 2 * num_kv_heads) * head_dim, k) or weight.stride(1) != 1
            or not fusable_head_dim(head_dim)):
        raise ValueError("norm_qkv_rope_store needs [rows, hidden] inputs with unit stride, a [(heads + 2 * kv_heads)"
                         " * head_dim, hidden] weight, and a power-of-two head_dim of at least 32")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or cos_table.stride(-1) != 1 \
            or sin_table.stride(0) != cos_table.stride(0) or positions.stride(0) != 1 or slot_mapping.stride(0) != 1:
        raise ValueError("norm_qkv_rope_store needs unit stride along head_dim and contiguous positions and slots")
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty_like(x)
    if m:
        block_m = config.rows_per_program(m)
        upcast, precision = dot_mode(x.dtype)
        res = x if residual is None else residual
        grid = (triton.cdiv(m, block_m), num_heads + 2 * num_kv_heads)
        launch_fitting(
            _norm_qkv_rope_store_kernel, grid,
            x, res, total, norm_weight, weight, weight if bias is None else bias, q, cos_table, sin_table, positions,
            slot_mapping, k_cache, v_cache, m, k, num_heads, num_kv_heads, x.stride(0), res.stride(0), total.stride(0),
            weight.stride(0), q.stride(0), q.stride(1), cos_table.stride(0), k_cache.shape[1],
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), eps, HAS_RES=residual is not None, HAS_BIAS=bias is not None, HALF=head_dim // 2,
            BLOCK_M=block_m, BLOCK_K=config.block_k, UPCAST=upcast, DOT_PRECISION=precision,
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(config.pdl, x.device),
        )
    return total, q


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write `key`/`value` ([tokens, kv_heads, head_dim]) into their flat slots; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    for t in (key, value, k_cache, v_cache):
        if t.stride(-1) != 1 or t.stride(-2) != head_dim:
            raise ValueError("store_kv needs each token's [kv_heads, head_dim] contiguous")
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0), k_cache.shape[1],
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        ROW=row, ROW_P=triton.next_power_of_2(row), **small_ops_launch(key.device))
