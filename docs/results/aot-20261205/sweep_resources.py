"""Registers, spills and shared memory of the GPU check's sweep configs for SmolLM2-135M's batch-256 decode
step in bfloat16, compiled for sm_90 as the JIT specializes the step's launches.

    env -u TRITON_INTERPRET PYTHONPATH=. python docs/results/aot-20261205/sweep_resources.py
"""
import dataclasses
import itertools
import json

import torch

from kernels import triton_attention, triton_linear
from kernels.triton_aot import compile_variant, ptxas_resources, record
from kernels.triton_attention import TritonPagedAttention
from loadtest.gpu_check.attention_sweep import EXTRA, GRID
from loadtest.gpu_check.linear_sweep import _grid
from workers.kernel_variants import BLOCK_SIZE, _configs, _model, _step

model = _model("smollm2-135m", torch.bfloat16)
a = model.args
cache = torch.empty(a.num_layers, 2, 1024, BLOCK_SIZE, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16, device="meta")
caches = [(cache[i, 0], cache[i, 1]) for i in range(a.num_layers)]
attn = TritonPagedAttention("meta")
rows = []
attention = [triton_attention.LaunchConfig(*v) for v in itertools.product(*GRID.values())]
attention += [triton_attention.LaunchConfig(*v) for v in EXTRA]
for config in attention:
    with record() as seen, _configs(config, triton_linear.NORM_LINEAR_CONFIG):
        _step(model, attn, caches, [1] * 256, 256)
    for variant, kernel in seen.items():
        if variant.name in ("_paged_attention_kernel", "_combine_splits_kernel"):
            built = compile_variant(kernel, variant, 90)
            rows.append({"config": dataclasses.asdict(config), "kernel": variant.name,
                         "shared_memory": built.metadata.shared, **ptxas_resources(built.asm["ptx"], 90),
                         "pipelined": "async_copy_global_to_local" in built.asm["ttgir"]})
for config in _grid(False):
    with record() as seen, _configs(triton_attention.DECODE_CONFIG, config):
        _step(model, attn, caches, [1] * 256, 256)
    for variant, kernel in seen.items():
        if variant.name in ("_norm_linear_kernel", "_norm_qkv_rope_store_kernel"):
            built = compile_variant(kernel, variant, 90)
            consts = {variant.signature[i][0]: v for i, v in variant.constexprs}
            rows.append({"config": dataclasses.asdict(config), "kernel": variant.name,
                         "gated": consts.get("GATED"), "norm": consts.get("NORM"), "has_res": consts.get("HAS_RES"),
                         "shared_memory": built.metadata.shared, **ptxas_resources(built.asm["ptx"], 90),
                         "pipelined": "async_copy_global_to_local" in built.asm["ttgir"]})
print(json.dumps(rows, indent=1))
