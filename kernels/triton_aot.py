"""Compile every Triton kernel variant the engine can launch, ahead of time, for a CUDA architecture, on a
machine without a GPU (Triton ships its own ptxas). `python -m kernels.triton_aot --arch 90` prints one JSON
line: how many variants compiled and which failed, so GPU-only compile errors surface in CPU-only CI.

Variants are the kernels' compile-time constants: dtype, the query-head group and head size of the Llama
shapes we serve (SmolLM2's 9/3 heads of 64, Llama-3's 32/8 of 128, MHA and MQA), and the store row width."""

from __future__ import annotations

import argparse
import inspect
import json
import sys

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SHAPES = [(1, 64), (3, 64), (2, 32), (4, 128), (8, 128), (1, 128)]  # (query heads per KV head, head_dim)
STORE_ROWS = [3 * 64, 2 * 32, 8 * 128]  # kv_heads * head_dim


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
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton_attention import _paged_attention_kernel, _store_kv_kernel, tile_shape

    target = GPUTarget("cuda", arch, 32)
    compiled, failed = 0, []

    def build(fn, sig, consts, label):
        nonlocal compiled
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
            compiled += 1
        except Exception as e:  # report every failure, not just the first
            failed.append(f"{label}: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")

    for short in DTYPES:
        ptr = f"*{short}"
        for group, head_dim in SHAPES:
            block_q, group_p, head_dim_p = tile_shape(group, head_dim)
            upcast = short == "fp32"
            consts = dict(GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_Q=block_q,
                          BLOCK_N=32, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32")
            pointers = {n: ptr for n in ("q_ptr", "k_cache", "v_cache", "out_ptr")}
            pointers.update({n: "*i64" for n in ("block_tables", "seq_lens", "query_start_loc")})
            sig, cx = _signature(_paged_attention_kernel, pointers, {"scale"}, consts)
            build(_paged_attention_kernel, sig, cx, f"attention {short} group={group} head_dim={head_dim}")
        for row in STORE_ROWS:
            pointers = {n: ptr for n in ("key", "value", "k_cache", "v_cache")}
            pointers["slot_mapping"] = "*i64"
            sig, cx = _signature(_store_kv_kernel, pointers, set(), dict(ROW=row, ROW_P=triton.next_power_of_2(row)))
            build(_store_kv_kernel, sig, cx, f"store_kv {short} row={row}")
    return {"arch": arch, "triton": triton.__version__, "compiled": compiled, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    report = compile_all(parser.parse_args(argv).arch)
    print(json.dumps(report))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
