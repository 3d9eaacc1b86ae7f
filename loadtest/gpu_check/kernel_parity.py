"""Triton paged attention against the torch backend on the same device and inputs: a mixed batch of decodes
and chunks over scattered blocks, per dtype, block size and head shape; the largest absolute difference. And
whether the optional FlashAttention packages are there and pass their self-check."""

from __future__ import annotations

import torch

from kernels.attention import CommonAttentionMetadata, get_attention_backend


def _paged_inputs(batch, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """Cached context in random blocks, the step's new K/V with their slots, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-ctx // block_size) for _, ctx in batch)
    num_blocks = need + 8
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, new_k, new_v = [], [], [], []
    for q_len, ctx in batch:
        blocks = torch.tensor([free.pop() for _ in range(-(-ctx // block_size))])
        k = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        pos = torch.arange(ctx)
        flat = blocks[pos // block_size] * block_size + pos % block_size
        cached = flat[:ctx - q_len]
        k_cache.view(-1, kv_heads, dim)[cached] = k[:ctx - q_len]
        v_cache.view(-1, kv_heads, dim)[cached] = v[:ctx - q_len]
        slots.append(flat[ctx - q_len:])
        new_k.append(k[ctx - q_len:])
        new_v.append(v[ctx - q_len:])
        tables.append(blocks.tolist())
    width = max(map(len, tables))
    q_lens = torch.tensor([q for q, _ in batch])
    return (k_cache, v_cache, torch.cat(new_k), torch.cat(new_v), q_lens,
            torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.cat(slots),
            torch.tensor([c for _, c in batch]))


def attention_case(device: torch.device, dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, dim: int,
                   batch, seed: int = 0) -> float:
    """Max |triton - torch| over the step's attention output (both backends write the new K/V themselves)."""
    k_cache, v_cache, key, value, q_lens, tables, slots, ctx = _paged_inputs(batch, block_size, kv_heads, dim,
                                                                             dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(int(q_lens.sum()), heads, dim, generator=gen).to(dtype).to(device)
    common = CommonAttentionMetadata(q_lens, torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]), ctx,
                                     tables, slots, block_size, heads, kv_heads)
    outs = []
    for name in ("triton", "torch"):
        backend = get_attention_backend(name, device)
        kc, vc = k_cache.to(device), v_cache.to(device)
        meta = backend.build_metadata(common)
        backend.write_kv(kc, vc, key.to(device), value.to(device), meta)
        outs.append(backend.forward(query, kc, vc, meta, dim ** -0.5).float())
    return float((outs[0] - outs[1]).abs().max())


def optional_backends(device: torch.device) -> dict[str, str]:
    """Whether each optional attention package (`kernels/flash_attention.py`) is on this machine and passes
    its self-check at SmolLM2-135M's heads in bfloat16, at its smallest block size: what `auto` would take."""
    from kernels.attention import AttentionSpec
    from kernels.flash_attention import FlashAttnPagedAttention, VllmFlashAttnPagedAttention

    found = {}
    for cls in (VllmFlashAttnPagedAttention, FlashAttnPagedAttention):
        spec = AttentionSpec(cls.block_multiple, torch.bfloat16, 9, 3, 64)
        try:
            get_attention_backend(cls.name, device, spec)
            found[cls.name] = f"passed its self-check at block size {cls.block_multiple}"
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
