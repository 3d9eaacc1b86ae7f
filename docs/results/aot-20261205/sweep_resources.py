"""Registers, spills and shared memory of the GPU check's sweep configs for SmolLM2-135M's batch-256 decode
step in bfloat16, compiled for sm_90 as the JIT specializes the step's launches.

    env -u TRITON_INTERPRET PYTHONPATH=. python docs/results/aot-20261205/sweep_resources.py
"""
import dataclasses
import json

import torch

from kernels import triton_attention, triton_linear
from kernels.triton_aot import compile_variant, ptxas_resources
from loadtest.gpu_check import attention_sweep, linear_sweep
from workers.kernel_variants import config_variants

ATTENTION = ("_paged_attention_kernel", "_combine_splits_kernel")
LINEAR = ("_norm_linear_kernel", "_norm_qkv_rope_store_kernel")
rows = []
configs = [(a, triton_linear.NORM_LINEAR_CONFIG, a, ATTENTION) for a in attention_sweep.sweep_configs(False)]
configs += [(triton_attention.DECODE_CONFIG, c, c, LINEAR) for c in linear_sweep.sweep_configs(False)]
for decode, linear, swept, kernels in configs:
    for variant, kernel in config_variants("smollm2-135m", torch.bfloat16, [(decode, linear)], ((256, 256),)).items():
        if variant.name in kernels:
            built = compile_variant(kernel, variant, 90)
            consts = {variant.signature[i][0]: v for i, v in variant.constexprs}
            row = {"config": dataclasses.asdict(swept), "kernel": variant.name}
            if kernels is LINEAR:
                row |= {"gated": consts.get("GATED"), "norm": consts.get("NORM"), "has_res": consts.get("HAS_RES")}
            rows.append(row | {"shared_memory": built.metadata.shared, **ptxas_resources(built.asm["ptx"], 90),
                               "pipelined": "async_copy_global_to_local" in built.asm["ttgir"]})
print(json.dumps(rows, indent=1))
