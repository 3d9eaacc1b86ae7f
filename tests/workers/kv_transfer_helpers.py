"""What the KV transfer tests share: a small random KV cache, a payload's raw bits, and offering a request's
payload from a sender."""

from __future__ import annotations

import torch

from workers.kv_transfer import KVLayout, KVSender, KVTransferMeta, pack_kv

LAYERS, HEADS, HEAD_DIM = 3, 2, 8


def make_cache(num_blocks: int, block_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, num_blocks, block_size, HEADS, HEAD_DIM, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def offer(sender: KVSender, cache: torch.Tensor, request_id: str):
    """Offer a request's payload; returns a copy of it (the offered tensor may be the sender's) and the ticket."""
    payload = pack_kv(cache, [0, 1], 20)
    meta = KVTransferMeta(request_id, 20, KVLayout.of(cache, "m"), sender.transport, payload.nbytes)
    return payload.clone(), sender.offer(request_id, payload, meta)
