"""What moves when one request's KV cache goes from a prefill replica to a decode replica: the layout both
pools must share, the header of a transfer, and packing a request's blocks into one payload and back.

Wire format: a `KVTransferMeta` header plus one contiguous payload tensor of shape
`[num_layers, 2, num_tokens, num_kv_heads, head_dim]` (dim 1: 0 = K, 1 = V) in the cache dtype, holding
only the request's used tokens in token order. The payload does not depend on either side's block table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class KVLayout:
    """What a KV payload's shape and bytes mean; both pools must agree before blocks move between them."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @classmethod
    def of(cls, kv_cache: torch.Tensor, model: str) -> KVLayout:
        """The layout of an engine's `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` cache."""
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(model, num_layers, num_kv_heads, head_dim, block_size, str(kv_cache.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ValueError naming every field (with both values) where the two pools differ."""
        diffs = [f"{f.name} {getattr(self, f.name)} vs {getattr(other, f.name)}"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise ValueError(f"prefill and decode pools differ: {', '.join(diffs)}")


@dataclass(frozen=True)
class KVTransferMeta:
    """Header of one transfer: which request, how many tokens, and the layout and size of its payload."""

    request_id: str
    num_tokens: int
    layout: KVLayout
    transport: str
    nbytes: int

    @property
    def payload_shape(self) -> tuple[int, ...]:
        a = self.layout
        return (a.num_layers, 2, self.num_tokens, a.num_kv_heads, a.head_dim)

    def check_payload(self, payload: torch.Tensor) -> None:
        """Raise ValueError unless `payload` has this header's shape, dtype and size."""
        problems = []
        if tuple(payload.shape) != self.payload_shape:
            problems.append(f"shape {tuple(payload.shape)} vs {self.payload_shape}")
        if str(payload.dtype) != self.layout.dtype:
            problems.append(f"dtype {payload.dtype} vs {self.layout.dtype}")
        if payload.nbytes != self.nbytes:
            problems.append(f"nbytes {payload.nbytes} vs {self.nbytes}")
        if problems:
            raise ValueError(f"KV payload for request {self.request_id!r} does not match its header: "
                             f"{', '.join(problems)}")


def _token_slots(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Flat slot (block * block_size + offset) of each of the first `num_tokens` tokens."""
    num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
    needed = -(-num_tokens // block_size)
    if num_tokens < 0 or len(block_ids) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {block_size}, got {len(block_ids)}")
    blocks = torch.tensor(block_ids[:needed], dtype=torch.long)
    if needed and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(f"block ids {block_ids[:needed]} out of range for a pool of {num_blocks} blocks")
    t = torch.arange(num_tokens)
    return (blocks[t // block_size] * block_size + t % block_size).to(kv_cache.device)


def _flat_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as `[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]`, sharing storage."""
    if kv_cache.dim() != 6 or not kv_cache.is_contiguous():
        raise ValueError(f"expected a contiguous 6-d KV cache, got shape {tuple(kv_cache.shape)}")
    num_layers, two, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    return kv_cache.view(num_layers, two, num_blocks * block_size, num_kv_heads, head_dim)


def pack_kv(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Gather a request's first `num_tokens` tokens into one contiguous payload (see module docstring)."""
    return _flat_view(kv_cache).index_select(2, _token_slots(kv_cache, block_ids, num_tokens))


def unpack_kv(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int, payload: torch.Tensor) -> None:
    """Scatter a payload into this cache's blocks `block_ids`; other blocks are left untouched."""
    num_layers, _, _, _, num_kv_heads, head_dim = kv_cache.shape
    expected = (num_layers, 2, num_tokens, num_kv_heads, head_dim)
    if tuple(payload.shape) != expected or payload.dtype != kv_cache.dtype:
        raise ValueError(f"KV payload {tuple(payload.shape)} {payload.dtype} does not fit this cache: "
                         f"expected {expected} {kv_cache.dtype}")
    slots = _token_slots(kv_cache, block_ids, num_tokens)
    _flat_view(kv_cache).index_copy_(2, slots, payload.to(kv_cache.device))
