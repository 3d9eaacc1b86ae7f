"""Every Triton kernel variant the engine launches on a GPU, compiled ahead of time for a CUDA architecture on a
machine without one: `python -m workers.kernel_variants --arch 90 [--resources]` prints one JSON line (how
many compiled, which failed; with `--resources` each variant's shared memory, registers and spills).

The variants are the launches themselves (`kernels.triton_aot.record`): the model of each served shape, two
layers of it on the meta device (no memory, no kernel runs), steps through the Triton attention backend and
layer ops as the model runner makes them: decode steps of 1 to 256 sequences (the CUDA graphs' sizes, with
block tables as wide as theirs), prefill chunks beside decodes, a prompt at the fused kernels' row limit and
one past it, in bfloat16, float16 and float32; then a decode step each with its keys split between programs,
with the fused norm-and-matmul kernels' plain matmuls, and with programmatic dependent launch (`pdl`) and
without. The steps run with the default layer ops (`NORM_LINEAR_CONFIG`: the norms and matmuls apart) and again
with the fused norm-and-matmul kernels, which a GPU check's sweep applies where they win, and (from sm_90) with
the small kernels' programmatic dependent launch the other way (`SMALL_OPS_PDL`). The JIT specializes each
launch on its values (an integer's divisibility by 16, a 1), so the step shapes are chosen to reach every class:
1, 3, 16, 40, 256 rows; and the automatic splits of a decode step are counted for an H100's or H200's 132 SMs
(`triton_attention.META_SM_COUNT`): at SmolLM2-135M's 3 KV heads 16 at 1 and 3 sequences, 5 at 16, 2 at 40,
none at 256."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from typing import Any, Iterator

import torch

from kernels import triton_attention, triton_linear
from kernels.triton_aot import Variant, compile_variants, record
from kernels.triton_attention import TritonAttentionMetadata, TritonPagedAttention
from kernels.triton_layer_ops import TritonLayerOps
from workers.models.llama import LlamaForCausalLM, ModelArgs

# (hidden, heads, KV heads, head_dim, intermediate, qkv bias): SmolLM2-135M (the default model), Llama-3.2-1B,
# Llama-3-8B, Llama-2-7B (no grouped heads), Qwen2-0.5B (a bias on qkv), one KV head (an integer 1, which the
# JIT compiles as a constant), and a tiny test model's
SHAPES = {"smollm2-135m": (576, 9, 3, 64, 1536, False), "llama-3.2-1b": (2048, 32, 8, 64, 8192, False),
          "llama-3-8b": (4096, 32, 8, 128, 14336, False), "llama-2-7b": (4096, 32, 32, 128, 11008, False),
          "qwen2-0.5b": (896, 14, 2, 64, 4864, True), "mqa": (2048, 16, 1, 128, 5632, False),
          "tiny": (64, 4, 2, 32, 128, False)}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_SIZE = 16  # the engine's default
MAX_MODEL_LEN = 4096
VOCAB = 1024
# decode steps: (sequences, block table width): a graph's table is as wide as max_model_len allows (256 blocks
# here); steps run eagerly as wide as their longest sequence
DECODE_STEPS = ((1, 256), (3, 7), (16, 256), (40, 13), (256, 256))
# steps with prompt chunks: each sequence's new tokens (a decode has 1)
CHUNK_STEPS = ((17, 1, 1), (512,), (600,))


def _model(shape: str, dtype: torch.dtype) -> LlamaForCausalLM:
    hidden, heads, kv_heads, head_dim, inter, bias = SHAPES[shape]
    args = ModelArgs(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_layers=2, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     qkv_bias=bias, inv_freq=torch.ones(head_dim // 2))
    with torch.device("meta"):
        model = LlamaForCausalLM(args).to(dtype)
    model.init_rope(MAX_MODEL_LEN, dtype)
    model.ops = TritonLayerOps()
    return model


def _step(model: LlamaForCausalLM, attn: TritonPagedAttention, caches: list, new_tokens: list[int], width: int) -> None:
    """One forward pass of sequences with `new_tokens` each (after some cached ones), the logits of their last."""
    meta = torch.device("meta")
    n, tokens = len(new_tokens), sum(new_tokens)
    step = TritonAttentionMetadata(torch.empty(tokens, dtype=torch.long, device=meta),
                                   torch.empty(n, width, dtype=torch.long, device=meta),
                                   torch.empty(n, dtype=torch.long, device=meta),
                                   torch.empty(n + 1, dtype=torch.long, device=meta))
    ids = torch.empty(tokens, dtype=torch.long, device=meta)
    model(ids, torch.empty(tokens, dtype=torch.long, device=meta), caches, attn, step,
          torch.empty(n, dtype=torch.long, device=meta))


@contextlib.contextmanager
def _configs(decode: triton_attention.LaunchConfig, linear: triton_linear.LinearConfig | None,
             small_pdl: bool | None = None) -> Iterator[None]:
    """The decode attention's and the norm-and-matmul kernels' configs, and (unless None) `SMALL_OPS_PDL`."""
    saved = triton_attention.DECODE_CONFIG, triton_linear.NORM_LINEAR_CONFIG, triton_linear.SMALL_OPS_PDL
    triton_attention.DECODE_CONFIG, triton_linear.NORM_LINEAR_CONFIG = decode, linear
    if small_pdl is not None:
        triton_linear.SMALL_OPS_PDL = small_pdl
    try:
        yield
    finally:
        triton_attention.DECODE_CONFIG, triton_linear.NORM_LINEAR_CONFIG, triton_linear.SMALL_OPS_PDL = saved


def _meta_caches(model: LlamaForCausalLM, dtype: torch.dtype) -> list:
    a = model.args
    cache = torch.empty(a.num_layers, 2, 1024, BLOCK_SIZE, a.num_kv_heads, a.head_dim, dtype=dtype, device="meta")
    return [(cache[i, 0], cache[i, 1]) for i in range(a.num_layers)]


def engine_variants(shapes: tuple[str, ...] = tuple(SHAPES), dtypes: tuple[torch.dtype, ...] = DTYPES,
                    pdl: bool = True) -> dict[Variant, Any]:
    """The variants the engine's steps launch (see the module docstring), in first-launch order; those with
    programmatic dependent launch only with `pdl` (a GPU from sm_90: `triton_linear.pdl_launch`)."""
    attn = TritonPagedAttention("meta")
    decode, linear = triton_attention.DECODE_CONFIG, triton_linear.NORM_LINEAR_CONFIG
    small = triton_linear.SMALL_OPS_PDL and pdl
    if not pdl:  # what a GPU without it launches (`triton_linear.pdl_launch`)
        decode = dataclasses.replace(decode, pdl=False)
        linear = linear and dataclasses.replace(linear, pdl=False)
    fused = linear or triton_linear.LinearConfig(pdl=decode.pdl)
    # every step with the default's layer ops, and with the fused kernels where the default has the norms and
    # matmuls apart (a GPU check's sweep applies them where they win); the other way at one step. With `pdl`
    # every step again with the small kernels' programmatic dependent launch the other way (the linear sweep
    # times both and may apply either)
    mains = [(decode, linear, small)] + ([(decode, fused, small)] if linear is None else [])
    if pdl:
        mains.append((decode, linear, not small))
    others = [(dataclasses.replace(decode, num_splits=4), linear, small),
              (decode, dataclasses.replace(fused, plain_matmuls=True), small)]
    if linear is not None:
        others.append((decode, None, small))
    if pdl:
        # with programmatic dependent launch and without (the GPU check's sweeps time both): every fused kernel,
        # split or not
        others += [(dataclasses.replace(decode, pdl=not decode.pdl), dataclasses.replace(fused, pdl=not fused.pdl),
                    small),
                   (dataclasses.replace(decode, num_splits=4, pdl=True),
                    dataclasses.replace(fused, plain_matmuls=True, pdl=True), small)]
    with record() as seen:
        for shape in shapes:
            for dtype in dtypes:
                model = _model(shape, dtype)
                caches = _meta_caches(model, dtype)
                for config in mains:
                    with _configs(*config):
                        for n, width in DECODE_STEPS:
                            _step(model, attn, caches, [1] * n, width)
                        for chunks in CHUNK_STEPS:
                            _step(model, attn, caches, list(chunks), 64)
                for config in others:
                    with _configs(*config):
                        _step(model, attn, caches, [1] * 3, 7)
    return seen


def config_variants(shape: str, dtype: torch.dtype, configs: list[tuple],
                    steps: tuple = DECODE_STEPS) -> dict[Variant, Any]:
    """The variants decode steps of `shape` (sequences, block-table width) launch under each of `configs`, pairs
    of a decode attention `LaunchConfig` and a fused norm-and-matmul `LinearConfig` (or None): what a sweep over
    them compiles."""
    attn = TritonPagedAttention("meta")
    model = _model(shape, dtype)
    caches = _meta_caches(model, dtype)
    with record() as seen:
        for config in configs:
            with _configs(*config):
                for n, width in steps:
                    _step(model, attn, caches, [1] * n, width)
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (default 90: H100/H200)")
    parser.add_argument("--resources", action="store_true",
                        help="also each variant's shared memory, registers and spills (default: counts only)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"model shapes (default: all of {', '.join(SHAPES)})")
    args = parser.parse_args(argv)
    shapes = tuple(s for s in args.shapes.split(",") if s)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    report = compile_variants(engine_variants(shapes, pdl=args.arch >= 90), args.arch, args.resources)
    print(json.dumps(report))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
