"""Every Triton kernel variant the engine launches, compiled ahead of time for an H200 (sm_90) with Triton's
bundled ptxas, as the JIT specializes each launch (`kernels/triton_aot.py`, `workers/kernel_variants.py`).

Each check runs in a fresh process without Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1,
under which kernels are not JIT functions and nothing is recorded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"_paged_attention_kernel", "_combine_splits_kernel", "_norm_qkv_rope_store_kernel", "_norm_linear_kernel",
           "_rms_norm_kernel", "_rope_store_kv_kernel", "_silu_and_mul_kernel"}


def _run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_variant_the_engine_launches_compiles_for_sm90():
    """What only the GPU compiler rejects (layouts, dot shapes, dtypes, shared memory past the limit) fails
    here, for each kernel the model's steps launch at every served shape."""
    proc = _run(["-m", "workers.kernel_variants", "--arch", "90"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failed"] == []
    assert set(report["variants_per_kernel"]) == KERNELS
    assert report["compiled"] >= 300
    assert 0 < report["most_shared_memory"] <= report["shared_memory_limit"]


def test_variants_fit_the_shared_memory_of_an_sm89_gpu_with_fewer_stages():
    """An L4, L40S or A10 gives a block 99 KB of shared memory, not an H200's 227: the float32 fused kernels' three
    pipeline stages (107 KB at 32 rows, head_dim 128) do not fit, two do, and `launch_fitting` launches those."""
    proc = _run(["-m", "workers.kernel_variants", "--arch", "89", "--shapes", "llama-3-8b"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failed"] == [] and report["compiled"] >= 50
    assert report["most_shared_memory"] <= report["shared_memory_limit"] == 101376
    assert report["fewer_stages"] and all("UPCAST=True" in v and "2 stages fit" in v for v in report["fewer_stages"])


SCRIPT = textwrap.dedent('''
    import json
    import torch, triton, triton.language as tl
    from kernels.triton_aot import compile_variant, record
    from workers.kernel_variants import engine_variants

    @triton.jit
    def probe(x_ptr, n, stride, scale, C: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, C), tl.load(x_ptr + tl.arange(0, C)) * scale)

    x = torch.empty(64, device="meta")
    with record() as seen:
        probe[(1,)](x, 1, 3072, 0.5, C=16, num_warps=2)
        probe[(1,)](x[1:], 17, 40, 0.5, C=16)
    first, second = [dict(signature=v.signature, constexprs=v.constexprs, attrs=v.attrs, options=v.options)
                     for v in seen]
    seen = engine_variants(("smollm2-135m",), (torch.bfloat16,))
    def decode_step(v):  # one query per sequence, no splits, a batch divisible by 16 (16 or 256 sequences)
        consts, aligned = dict(v.constexprs), {i for i, _ in v.attrs}
        return (v.name == "_paged_attention_kernel" and consts[names.index("ONE_QUERY")] is True
                and consts[names.index("SPLIT")] is False and names.index("num_seqs") in aligned)
    def pdl_on(v):  # launched with programmatic dependent launch, and compiled to wait (PDL=True)
        params = [n for n, _ in v.signature]
        return dict(v.options).get("launch_pdl") and "PDL" in params and dict(v.constexprs)[params.index("PDL")]
    names = [n for n, _ in next(v for v in seen if v.name == "_paged_attention_kernel").signature]
    decode = [v for v in seen if decode_step(v)]
    ttgir = compile_variant(seen[decode[0]], decode[0], 90).asm["ttgir"]
    print(json.dumps(dict(first=first, second=second, decode_count=len(decode), decode_names=names,
                          decode_attrs=[names[i] for i, _ in decode[0].attrs],
                          decode_constexprs={names[i]: v for i, v in decode[0].constexprs},
                          pipelined="async_copy_global_to_local" in ttgir,
                          kernels=sorted({v.name for v in seen}),
                          pdl=sorted({v.name for v in seen if pdl_on(v)}),
                          pdl_off=sorted({v.name for v in seen if not pdl_on(v)}))))
''')


def test_variants_are_specialized_as_the_jit_does(tmp_path):
    """An integer 1 compiles as a constant, one divisible by 16 and a 16-byte aligned tensor as such (not a
    view one element in); the batch-256 decode step's attention is recorded with its batch, and compiled
    with the JIT's divisibility its key loop's loads are pipelined through shared memory (without it,
    every K/V gather waited for the one before)."""
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    proc = _run([str(script)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second = out["first"], out["second"]
    assert dict(first["signature"])["n"] == "constexpr" and [1, 1] in first["constexprs"]
    assert dict(first["signature"])["stride"] == "i32" and [2, 16] in first["attrs"] and [0, 16] in first["attrs"]
    assert dict(first["signature"])["scale"] == "fp32" and ["num_warps", 2] in first["options"]
    assert [4, 16] in first["constexprs"]
    assert dict(second["signature"])["n"] == "i32" and second["attrs"] == []  # 17, 40 and x[1:]: none of them
    assert out["decode_count"] == 1
    assert out["decode_names"][7] == "num_seqs"
    aligned = {"k_cache", "v_cache", "stride_kb", "stride_ks", "stride_kh", "block_size", "num_seqs"}
    assert aligned <= set(out["decode_attrs"])
    assert out["decode_constexprs"]["num_splits"] == 1 and out["decode_constexprs"]["ONE_QUERY"] is True
    assert out["pipelined"]
    assert set(out["kernels"]) == KERNELS
    # launched with programmatic dependent launch, and compiled to wait for the kernel before: the fused ones,
    # and (`SMALL_OPS_PDL`, which the linear sweep may apply) the small ones beside cuBLAS's matmuls, both ways
    small = ["_rms_norm_kernel", "_rope_store_kv_kernel", "_silu_and_mul_kernel"]
    assert out["pdl"] == sorted(["_combine_splits_kernel", "_norm_linear_kernel", "_norm_qkv_rope_store_kernel",
                                 "_paged_attention_kernel", *small])
    assert set(small) <= set(out["pdl_off"])


SAME_KEY = textwrap.dedent("""
    import json
    import torch
    from triton import knobs
    from triton.compiler.compiler import get_cache_invalidating_env_vars, get_cache_key, make_backend
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, create_function_from_signature
    from kernels.triton_aot import jit_source, specialize
    from kernels.triton_attention import TritonPagedAttention
    from workers.kernel_variants import _meta_caches, _model, _step

    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    model = _model("qwen2-0.5b", torch.bfloat16)
    caches = _meta_caches(model, torch.bfloat16)
    attn = TritonPagedAttention("meta")
    for new_tokens, width in (([1] * 256, 256), ([1], 3), ([17, 1, 1], 7), ([600], 40)):
        _step(model, attn, caches, new_tokens, width)

    backend = make_backend(GPUTarget("cuda", 90, 32))
    env = get_cache_invalidating_env_vars()

    def key(src, options):
        return get_cache_key(src, backend, backend.parse_options(dict(options.__dict__)), env)

    same, different = 0, []
    for kernel, args, kwargs in launches:
        # what a launch does on a GPU (JITFunction.run): its binder, then _pack_args
        kw = dict(kwargs, debug=knobs.runtime.debug or False,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kw)
        options, signature, consts, attrs = kernel._pack_args(backend, kw, bound, specialization, options)
        jit = key(ASTSource(kernel, signature, consts, attrs), options)
        src, options, _ = jit_source(kernel, specialize(kernel, args, kwargs), 90)
        if key(src, options) == jit:
            same += 1
        else:
            different.append(kernel.fn.__name__)
    print(json.dumps({"launches": len(launches), "same": same, "different": different}))
""")


def test_compiled_variants_land_under_the_key_the_jit_looks_up(tmp_path):
    """Compiled from a recorded variant (`jit_source`), a kernel goes into Triton's cache under the key a launch
    of the same call computes through the JIT's own binder and `_pack_args`: on a GPU with the same Triton the
    JIT finds it there instead of compiling it."""
    script = tmp_path / "same_key.py"
    script.write_text(SAME_KEY)
    proc = _run([str(script)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["launches"] > 20 and out["same"] == out["launches"] and not out["different"]


DEPTH_SCRIPT = textwrap.dedent(r'''
    import dataclasses, json, re
    import torch
    from kernels import triton_attention, triton_linear
    from kernels.triton_aot import compile_variant
    from workers.kernel_variants import config_variants

    out = {"num_stages": triton_attention.DECODE_CONFIG.num_stages,
           "default_prefetch": [triton_attention.DECODE_CONFIG.prefetch, triton_attention.CHUNK_CONFIG.prefetch]}
    for prefetch in (True, False):
        config = dataclasses.replace(triton_attention.DECODE_CONFIG, prefetch=prefetch)
        seen = config_variants("smollm2-135m", torch.bfloat16, [(config, triton_linear.NORM_LINEAR_CONFIG)],
                               ((256, 64),))
        variant = next(v for v in seen if v.name == "_paged_attention_kernel")
        ttgir = compile_variant(seen[variant], variant, 90).asm["ttgir"]
        tile = rf"{config.block_n}x64xbf16"
        buffers = re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{tile}", ttgir)  # K's, V's
        waits = re.findall(r"async_wait[^{]*\{num = (\d+)", ttgir)  # copy groups left in flight
        out[str(prefetch)] = {"buffers": [int(n) for n in buffers], "waits": [int(n) for n in waits]}
    print(json.dumps(out))
''')


def test_the_decode_attention_keeps_key_tiles_in_flight():
    """The batch-256 decode attention compiled for sm_90 as the JIT compiles it: each tile's block ids loaded
    the tile before (`LaunchConfig.prefetch`, the default) give the keys and values `num_stages - 1`
    shared-memory buffers, and the loop's wait leaves the tiles ahead in flight; loaded in their own tile, the
    block ids and keys are a chain that the same stages pipeline less deep (up to 4 stages one buffer: a round
    trip per tile)."""
    proc = _run(["-c", DEPTH_SCRIPT], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    stages, on, off = report["num_stages"], report["True"], report["False"]
    assert report["default_prefetch"] == [True, True]
    assert stages >= 3 and on["buffers"] == [stages - 1] * 2  # keys and values
    assert max(on["waits"]) == 2 * (stages - 2) > 0  # in the loop: the next tiles' K and V copies in flight
    assert len(off["buffers"]) == 2 and max(off["buffers"]) < stages - 1  # the chain: shallower at any stages
    if stages <= 4:  # one buffer, each tile's copies waited for in full
        assert off["buffers"] == [1, 1] and set(off["waits"]) == {0}
