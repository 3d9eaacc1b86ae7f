"""The fused norm-and-matmul kernels' first loop (`triton_linear.row_scale`: each row's RMSNorm scale, before the
matmul), as the JIT compiles SmolLM2-135M's batch-256 decode variants (bfloat16, the default `LinearConfig`) for
sm_90: whether its loads are copied ahead with `cp.async` (pipelined), into how many buffers, and the waits' counts
of copies left in flight; with the kernel's shared memory and registers.

    env -u TRITON_INTERPRET PYTHONPATH=. python docs/results/pipeline-20261205/row_scale_pipelining.py
"""
import re

import torch
import triton

from kernels import triton_attention, triton_linear
from kernels.triton_aot import compile_variant, ptxas_resources
from workers.kernel_variants import config_variants

print("triton", triton.__version__)
config = triton_linear.LinearConfig()
variants = config_variants("smollm2-135m", torch.bfloat16, [(triton_attention.DECODE_CONFIG, config)], ((256, 64),))
for variant, kernel in variants.items():
    consts = {variant.signature[i][0]: v for i, v in variant.constexprs}
    if variant.name not in ("_norm_linear_kernel", "_norm_qkv_rope_store_kernel") or consts.get("NORM") is False:
        continue
    built = compile_variant(kernel, variant, 90)
    ttgir = built.asm["ttgir"]
    loop = ttgir.index("scf.for")
    body = ttgir[loop:ttgir.index("scf.yield", loop)]
    buffers = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x", ttgir[:loop])
    waits = re.findall(r"async_wait[^{]*[{]num = (\d+)", body)
    res = ptxas_resources(built.asm["ptx"], 90)
    print(f"{variant.name} GATED={consts.get('GATED')} HAS_RES={consts.get('HAS_RES')}: first loop "
          f"{'pipelined' if 'async_copy' in ttgir[:loop] else 'plain loads'}, buffers {buffers or '-'}, waits "
          f"{waits or '-'}; shared {built.metadata.shared / 1024:.1f} KB, "
          f"{res['registers']} registers, {res['spill_bytes']} B spilled")
