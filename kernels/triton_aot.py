"""Compile every Triton kernel variant the engine can launch, ahead of time, for a CUDA architecture, on a
machine without a GPU (Triton ships its own ptxas). `python -m kernels.triton_aot --arch 90` prints one JSON
line: how many variants compiled and which failed, so GPU-only compile errors surface in CPU-only CI.

Variants are the kernels' compile-time constants: dtype, the query-head group and head size of the Llama
shapes we serve (SmolLM2's 9/3 heads of 64, Llama-3's 32/8 of 128, MHA and MQA) under each launch config the
attention launches with (`launch_config`: by dtype, with one query per sequence or not), the store row width, for
the layer ops (`kernels.triton_layer_ops`) the hidden size, the heads and head size of the rotary kernel, and
for the fused norm-and-matmul (`kernels.triton_linear`, and with the rotary and K/V store in
`kernels.triton_kv_write`) each kind of projection at each tile height."""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import sys

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# the most shared memory one block may take (bytes; CUDA's opt-in maximum): a kernel compiled past it raises
# OutOfResources at its first launch, which compiling alone does not show
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
SHAPES = [(1, 64), (3, 64), (2, 32), (4, 128), (8, 128), (1, 128)]  # (query heads per KV head, head_dim)
STORE_ROWS = [3 * 64, 2 * 32, 8 * 128]  # kv_heads * head_dim
NORM_WIDTHS = [576, 2048, 4096, 8192]  # hidden sizes (SmolLM2-135M, Llama-3.2-1B, Llama-3-8B, -70B)
ROPE_SHAPES = [(9 + 3, 64), (32 + 8, 128), (8 + 2, 32)]  # (query + KV heads, head_dim)
ROPE_STORE_SHAPES = [(9, 3, 64), (32, 8, 128), (8, 2, 32)]  # (query heads, KV heads, head_dim)
# the fused norm-and-matmul's kinds (residual, bias, gated): the first layer's qkv, qkv, qkv with a bias, gate/up;
# the plain matmul (`plain_matmuls`) is compiled besides, with and without a bias
NORM_LINEAR_KINDS = [(False, False, False), (True, False, False), (True, True, False), (True, False, True)]


def _signature(fn, pointers: dict[str, str], floats: set[str], constexprs: dict) -> tuple[dict, dict]:
    names = list(inspect.signature(fn.fn).parameters)
    sig = {}
    for name in names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig, {(names.index(k),): v for k, v in constexprs.items()}


def compile_all(arch: int) -> dict:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton_attention import _combine_splits_kernel, _paged_attention_kernel, launch_config, tile_shape
    from kernels.triton_kv_write import _norm_qkv_rope_store_kernel, _rope_store_kv_kernel, _store_kv_kernel
    from kernels.triton_layer_ops import SILU_BLOCK, _norm_warps, _rms_norm_kernel, _rope_kernel, _silu_and_mul_kernel
    from kernels.triton_linear import NORM_LINEAR_CONFIG, LinearConfig, _norm_linear_kernel

    target = GPUTarget("cuda", arch, 32)
    compiled, failed = 0, []

    shared_limit = SHARED_MEMORY_LIMIT.get(arch)
    most_shared = 0

    def build(fn, sig, consts, label, options=None):
        nonlocal compiled, most_shared
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target, options=options)
        except Exception as e:  # report every failure, not just the first
            failed.append(f"{label}: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
            return
        shared = int(getattr(kernel.metadata, "shared", 0) or 0)
        most_shared = max(most_shared, shared)
        if shared_limit is not None and shared > shared_limit:  # the launch would raise OutOfResources
            failed.append(f"{label}: needs {shared} B of shared memory, the GPU has {shared_limit}")
            return
        compiled += 1

    for short in DTYPES:
        ptr = f"*{short}"
        for (group, head_dim), one_query in itertools.product(SHAPES, (True, False)):
            config = launch_config(getattr(torch, DTYPES[short]), one_query)
            block_q, group_p, head_dim_p = tile_shape(group, head_dim)
            upcast = short == "fp32"
            pointers = {n: ptr for n in ("q_ptr", "k_cache", "v_cache", "out_ptr")}
            pointers.update({n: "*i64" for n in ("block_tables", "seq_lens", "query_start_loc")})
            # a decode step's keys split between programs (`LaunchConfig.num_splits`; the sweep tries 2-4)
            for splits in (config.num_splits, 4) if one_query and short != "fp32" else (config.num_splits,):
                consts = dict(GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_Q=block_q,
                              BLOCK_N=config.block_n, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32",
                              ONE_QUERY=one_query, SPLIT=one_query and splits > 1)
                ptrs = dict(pointers, part_acc="*fp32" if splits > 1 else ptr, part_ml="*fp32" if splits > 1 else ptr)
                sig, cx = _signature(_paged_attention_kernel, ptrs, {"scale"}, consts)
                build(_paged_attention_kernel, sig, cx, f"attention {short} group={group} head_dim={head_dim} "
                      f"one_query={one_query} splits={splits} {config}",
                      {"num_warps": config.num_warps, "num_stages": config.num_stages})
        for head_dim in (64, 128):
            sig, cx = _signature(_combine_splits_kernel, {"part_acc": "*fp32", "part_ml": "*fp32", "out_ptr": ptr},
                                 set(), dict(HEAD_DIM=head_dim, HEAD_DIM_P=head_dim, SPLITS_P=16))
            build(_combine_splits_kernel, sig, cx, f"combine_splits {short} head_dim={head_dim}",
                  {"num_warps": 1 if head_dim <= 64 else 2})
        for row in STORE_ROWS:
            pointers = {n: ptr for n in ("key", "value", "k_cache", "v_cache")}
            pointers["slot_mapping"] = "*i64"
            sig, cx = _signature(_store_kv_kernel, pointers, set(), dict(ROW=row, ROW_P=triton.next_power_of_2(row)))
            build(_store_kv_kernel, sig, cx, f"store_kv {short} row={row}")
        for heads, kv_heads, head_dim in ROPE_STORE_SHAPES:
            pointers = {n: ptr for n in ("qk_ptr", "v_ptr", "cos_ptr", "sin_ptr", "k_cache", "v_cache")}
            pointers.update({"pos_ptr": "*i64", "slot_mapping": "*i64"})
            consts = dict(HALF=head_dim // 2, HEADS_P=triton.next_power_of_2(heads + kv_heads),
                          HALF_P=triton.next_power_of_2(head_dim // 2), KV_P=triton.next_power_of_2(kv_heads),
                          DIM_P=triton.next_power_of_2(head_dim))
            sig, cx = _signature(_rope_store_kv_kernel, pointers, set(), consts)
            build(_rope_store_kv_kernel, sig, cx, f"rope_store_kv {short} heads={heads}/{kv_heads} head_dim={head_dim}")
        for width in NORM_WIDTHS:
            block = triton.next_power_of_2(width)
            for has_res in (False, True):
                pointers = {n: ptr for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr")}
                sig, cx = _signature(_rms_norm_kernel, pointers, {"eps"}, dict(HAS_RES=has_res, BLOCK=block))
                build(_rms_norm_kernel, sig, cx, f"rms_norm {short} width={width} residual={has_res}",
                      {"num_warps": _norm_warps(block)})
        for heads, head_dim in ROPE_SHAPES:
            pointers = {n: ptr for n in ("x_ptr", "cos_ptr", "sin_ptr")}
            pointers["pos_ptr"] = "*i64"
            consts = dict(HALF=head_dim // 2, HEADS_P=triton.next_power_of_2(heads),
                          HALF_P=triton.next_power_of_2(head_dim // 2))
            sig, cx = _signature(_rope_kernel, pointers, set(), consts)
            build(_rope_kernel, sig, cx, f"rope {short} heads={heads} head_dim={head_dim}")
        sig, cx = _signature(_silu_and_mul_kernel, {"gu_ptr": ptr, "out_ptr": ptr}, set(), dict(BLOCK=SILU_BLOCK))
        build(_silu_and_mul_kernel, sig, cx, f"silu_and_mul {short}", {"num_warps": 4})
        # the fused norm-and-matmul: each tile height a step's rows round to, each kind of projection
        config = NORM_LINEAR_CONFIG or LinearConfig()
        heights = sorted({config.rows_per_program(rows) for rows in (1, 17, 33, 65, 129, config.max_rows)})
        upcast = short == "fp32"
        kinds = [(*kind, True) for kind in NORM_LINEAR_KINDS] + [(False, False, False, False), (False, True, False, False)]
        for block_m, (has_res, has_bias, gated, norm) in itertools.product(heights, kinds):
            pointers = {n: ptr for n in ("x_ptr", "res_ptr", "sum_ptr", "nw_ptr", "w_ptr", "b_ptr", "out_ptr")}
            consts = dict(HAS_RES=has_res, HAS_BIAS=has_bias, GATED=gated, BLOCK_M=block_m, BLOCK_N=config.block_n,
                          BLOCK_K=config.block_k, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32", NORM=norm)
            sig, cx = _signature(_norm_linear_kernel, pointers, {"eps"}, consts)
            build(_norm_linear_kernel, sig, cx,
                  f"{'norm_linear' if norm else 'linear'} {short} block_m={block_m} residual={has_res} bias={has_bias} "
                  f"gated={gated} {config}", {"num_warps": config.num_warps, "num_stages": config.num_stages})
        # ... and with the rotary and K/V store (a layer's input), per head size
        for block_m, (has_res, has_bias, _), head_dim in itertools.product(heights, NORM_LINEAR_KINDS[:3], (64, 128)):
            pointers = {n: ptr for n in ("x_ptr", "res_ptr", "sum_ptr", "nw_ptr", "w_ptr", "b_ptr", "q_ptr", "cos_ptr",
                                         "sin_ptr", "k_cache", "v_cache")}
            pointers.update({"pos_ptr": "*i64", "slot_mapping": "*i64"})
            consts = dict(HAS_RES=has_res, HAS_BIAS=has_bias, HALF=head_dim // 2, BLOCK_M=block_m,
                          BLOCK_K=config.block_k, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32")
            sig, cx = _signature(_norm_qkv_rope_store_kernel, pointers, {"eps"}, consts)
            build(_norm_qkv_rope_store_kernel, sig, cx,
                  f"norm_qkv_rope_store {short} block_m={block_m} residual={has_res} bias={has_bias} "
                  f"head_dim={head_dim} {config}", {"num_warps": config.num_warps, "num_stages": config.num_stages})
    return {"arch": arch, "triton": triton.__version__, "compiled": compiled, "failed": failed,
            "most_shared_memory": most_shared, "shared_memory_limit": shared_limit}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    report = compile_all(parser.parse_args(argv).arch)
    print(json.dumps(report))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
