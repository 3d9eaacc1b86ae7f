"""One paged attention step through a backend and through the torch backend (the reference), on the same
device and inputs: the largest absolute difference of their outputs. Cached context in shuffled blocks (a
busy pool's), the step's new keys and values written by each backend itself, prompt chunks beside decodes.
The optional packages' self-check (`kernels/flash_attention.py`) and the GPU check's kernel parity
(`loadtest/gpu_check/kernel_parity.py`) run it."""

from __future__ import annotations

import torch

from kernels.attention import AttentionBackend, CommonAttentionMetadata


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


def paged_difference(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, block_size: int,
                     heads: int, kv_heads: int, dim: int, batch, seed: int = 0) -> float:
    """Max |backend - torch| over the step's attention output; `batch`: (new tokens, context with them) per
    sequence."""
    from kernels.cpu_attention import TorchPagedAttention

    k_cache, v_cache, key, value, q_lens, tables, slots, ctx = _paged_inputs(batch, block_size, kv_heads, dim,
                                                                             dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(int(q_lens.sum()), heads, dim, generator=gen).to(dtype).to(device)
    common = CommonAttentionMetadata(q_lens, torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]), ctx,
                                     tables, slots, block_size, heads, kv_heads)
    outs = []
    for impl in (backend, TorchPagedAttention(device)):
        kc, vc = k_cache.to(device), v_cache.to(device)
        meta = impl.build_metadata(common)
        impl.write_kv(kc, vc, key.to(device), value.to(device), meta)
        outs.append(impl.forward(query, kc, vc, meta, dim ** -0.5).float())
    return float((outs[0] - outs[1]).abs().max())
