"""The fused norm-and-matmul kernels under the linear sweep's deeper configs: each config's batch-256 decode
variants for SmolLM2-135M (bfloat16) compiled for sm_90, with the shared memory, ptxas's registers and spills, and
the shared-memory buffers of the TTGIR (depth x rows x columns: the first the row-scale pre-pass's).

    env -u TRITON_INTERPRET PYTHONPATH=. python docs/results/prefetch-20261205/linear_resources.py
"""
import dataclasses, json, re
import torch
from kernels import triton_attention, triton_linear
from kernels.triton_aot import compile_variant, ptxas_resources
from workers.kernel_variants import config_variants
LINEAR = ("_norm_linear_kernel", "_norm_qkv_rope_store_kernel")
L = triton_linear.LinearConfig
for c in [L(), L(num_stages=4), L(num_stages=5), L(block_k=128), L(block_k=128, num_stages=4), L(block_k=128, num_stages=5),
          L(plain_matmuls=True), L(plain_matmuls=True, num_stages=5), L(plain_matmuls=True, block_k=128, num_stages=4)]:
    for variant, kernel in config_variants("smollm2-135m", torch.bfloat16, [(triton_attention.DECODE_CONFIG, c)], ((256, 256),)).items():
        if variant.name in LINEAR:
            built = compile_variant(kernel, variant, 90)
            consts = {variant.signature[i][0]: v for i, v in variant.constexprs}
            ttgir = built.asm["ttgir"]
            allocs = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x(\d+)x(\d+)xbf16", ttgir)
            res = ptxas_resources(built.asm["ptx"], 90)
            print(f"bk {c.block_k} st {c.num_stages} plain {int(c.plain_matmuls)} {variant.name[1:12]} gated {consts.get('GATED')} norm {consts.get('NORM')} "
                  f"smem {built.metadata.shared/1024:.1f} regs {res.get('registers')} spill bytes {res['spill_bytes']} allocs {allocs}", flush=True)
