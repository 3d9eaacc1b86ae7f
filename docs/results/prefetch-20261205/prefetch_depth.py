"""The decode attention's key loop by `LaunchConfig.prefetch` and pipeline stages: each config's batch-256 decode
variant for SmolLM2-135M (bfloat16), and its prefill-chunk variant (a 512-token step), compiled for sm_90 as
the JIT specializes them, read from the TTGIR (the shared-memory buffers the keys are copied into with
`cp.async`, the waits' counts of copy groups left in flight: K and V are one group each), with ptxas's
registers and the shared memory.

    env -u TRITON_INTERPRET PYTHONPATH=. python docs/results/prefetch-20261205/prefetch_depth.py
"""
import re

import torch
import triton

from kernels import triton_attention, triton_linear
from kernels.triton_aot import compile_variant, ptxas_resources
from kernels.triton_attention import TritonPagedAttention
from workers.kernel_variants import _configs, _meta_caches, _model, _step, record

print("triton", triton.__version__)
print("step   block_n warps stages prefetch | K/V buffers | waits | shared KB | registers")
model = _model("smollm2-135m", torch.bfloat16)
caches = _meta_caches(model, torch.bfloat16)
attn = TritonPagedAttention("meta")
# a decode step of 256 sequences (DECODE_CONFIG), and a step of one sequence's 512 prompt tokens (CHUNK_CONFIG)
for step, new_tokens, width in (("decode", [1] * 256, 64), ("chunk", [512], 64)):
    for block_n, warps in ((32, 4), (64, 4), (128, 8)):
        for stages in range(2, 8):
            for prefetch in (False, True):
                config = triton_attention.LaunchConfig(block_n=block_n, num_warps=warps, num_stages=stages,
                                                       prefetch=prefetch)
                saved = triton_attention.CHUNK_CONFIG
                triton_attention.CHUNK_CONFIG = config
                try:
                    with record() as variants, _configs(config, triton_linear.NORM_LINEAR_CONFIG):
                        _step(model, attn, caches, new_tokens, width)
                finally:
                    triton_attention.CHUNK_CONFIG = saved
                variant, kernel = next((v, k) for v, k in variants.items() if v.name == "_paged_attention_kernel")
                built = compile_variant(kernel, variant, 90)
                ttgir = built.asm["ttgir"]
                depth = re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{block_n}x64xbf16", ttgir)
                waits = re.findall(r"async_wait[^{]*\{num = (\d+)", ttgir)
                res = ptxas_resources(built.asm["ptx"], 90)
                print(f"{step:6} {block_n:7} {warps:5} {stages:6} {prefetch!s:>8} | {depth[0] if depth else '-':>11} | "
                      f"{','.join(waits):>9} | {built.metadata.shared / 1024:9.1f} | {res['registers']}", flush=True)
