"""Triton paged attention against the torch backend on the same device and inputs: a mixed batch of decodes
and chunks over scattered blocks, per dtype, block size and head shape; the largest absolute difference. And
whether the optional FlashAttention and FlashInfer packages are there and pass their self-check."""

from __future__ import annotations

import torch

from kernels.attention import get_attention_backend
from kernels.attention_check import paged_difference


def attention_case(device: torch.device, dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, dim: int,
                   batch, seed: int = 0) -> float:
    """Max |triton - torch| over the step's attention output (both backends write the new K/V themselves)."""
    return paged_difference(get_attention_backend("triton", device), device, dtype, block_size, heads, kv_heads, dim,
                            batch, seed)


def optional_backends(device: torch.device) -> dict[str, str]:
    """Whether each optional attention package (`kernels/flash_attention.py`, `kernels/flashinfer_attention.py`)
    is on this machine and passes its self-check at SmolLM2-135M's heads in bfloat16, at the smallest block
    size it takes from the engine's default (16) up: what `auto` would take."""
    from kernels.attention import AttentionSpec
    from kernels.flash_attention import FlashAttnPagedAttention, VllmFlashAttnPagedAttention
    from kernels.flashinfer_attention import FlashInferPagedAttention

    found = {}
    for cls in (VllmFlashAttnPagedAttention, FlashAttnPagedAttention, FlashInferPagedAttention):
        block_size = -(-16 // cls.block_multiple) * cls.block_multiple
        try:
            get_attention_backend(cls.name, device, AttentionSpec(block_size, torch.bfloat16, 9, 3, 64))
            found[cls.name] = f"passed its self-check at block size {block_size}"
        except ImportError as e:
            found[cls.name] = f"not installed ({e})"
        except Exception as e:
            found[cls.name] = f"not used: {type(e).__name__}: {e}"
    return found


def check_kernels(device: torch.device, heads_list, batch, tolerance: dict[str, float]) -> dict:
    cases = []
    for dtype_name in ("float32", "bfloat16"):
        for block_size in (1, 16, 32):
            for heads, kv_heads, dim in heads_list:
                err = attention_case(device, getattr(torch, dtype_name), block_size, heads, kv_heads, dim, batch)
                cases.append({"dtype": dtype_name, "block_size": block_size, "heads": heads, "kv_heads": kv_heads,
                              "head_dim": dim, "max_abs_error": err, "tolerance": tolerance[dtype_name],
                              "passed": err <= tolerance[dtype_name]})
    return {"passed": all(c["passed"] for c in cases), "batch": [list(b) for b in batch], "cases": cases,
            "optional_backends": optional_backends(device)}
