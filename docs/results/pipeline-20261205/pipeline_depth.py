"""How many tiles of keys and values the decode attention kernel holds in shared memory, by pipeline stages:
each config's batch-256 decode variant for SmolLM2-135M (bfloat16) compiled for sm_90 as the JIT specializes
it, read from its TTGIR (the depth of the shared-memory buffers the keys are copied into with `cp.async`, and
the waits' counts of copies left in flight), with ptxas's registers and the shared memory.

    env -u TRITON_INTERPRET PYTHONPATH=. python docs/results/pipeline-20261205/pipeline_depth.py
"""
import re

import torch
import triton

from kernels import triton_attention, triton_linear
from kernels.triton_aot import compile_variant, ptxas_resources
from workers.kernel_variants import config_variants

print("triton", triton.__version__)
print("block_n warps stages | K/V buffers | waits (copies left in flight) | shared KB | registers")
for block_n, warps in ((32, 4), (64, 4), (128, 8)):
    for stages in range(2, 8):
        config = triton_attention.LaunchConfig(block_n=block_n, num_warps=warps, num_stages=stages)
        variants = config_variants("smollm2-135m", torch.bfloat16, [(config, triton_linear.NORM_LINEAR_CONFIG)],
                                   ((256, 64),))
        for variant, kernel in variants.items():
            consts = {variant.signature[i][0]: v for i, v in variant.constexprs}
            if variant.name == "_paged_attention_kernel" and consts.get("ONE_QUERY"):
                built = compile_variant(kernel, variant, 90)
                ttgir = built.asm["ttgir"]
                depth = re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{block_n}x64xbf16", ttgir)
                waits = re.findall(r"async_wait[^{]*\{num = (\d+)", ttgir)
                res = ptxas_resources(built.asm["ptx"], 90)
                print(f"{block_n:7} {warps:5} {stages:6} | {depth[0] if depth else '-':>11} | {','.join(waits):>29} | "
                      f"{built.metadata.shared / 1024:9.1f} | {res['registers']}")
                break
