"""The attention-backend interface and its registry.

A backend builds per-step metadata once (from query lengths, context lengths and block tables) and then
serves every layer: `write_kv` stores the step's new keys/values into their slots, `forward` attends each
new token to its own request's cached context. KV caches are `[num_blocks, block_size, num_kv_heads,
head_dim]` per layer. GPU backends register here and import their libraries lazily."""

from __future__ import annotations

import importlib
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Step-wide inputs shared by all layers; `extra` holds what the backend precomputed."""

    slot_mapping: torch.Tensor  # [num_tokens] flat slot index (block_id * block_size + offset)
    query_lens: torch.Tensor  # [num_reqs]
    context_lens: torch.Tensor  # [num_reqs], including this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks], padded with 0
    extra: dict


class AttentionBackend(ABC):
    name: str = ""

    @abstractmethod
    def build_metadata(self, query_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                       slot_mapping: torch.Tensor, block_size: int, num_heads: int, num_kv_heads: int) -> AttentionMetadata:
        """Precompute what `forward` needs for this step. Requests' tokens are contiguous and in order."""

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Store `key`/`value` ([num_tokens, num_kv_heads, head_dim]) into their slots."""
        nkv, d = key.shape[-2:]
        k_cache.view(-1, nkv, d).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, nkv, d).index_copy_(0, meta.slot_mapping, value)

    @abstractmethod
    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Causal attention of `query` ([num_tokens, num_heads, head_dim]) over each request's context
        (cached tokens plus this step's); returns the same shape."""


_REGISTRY: dict[str, str] = {
    "torch": "kernels.cpu_attention:TorchPagedAttention",
    "cpp": "kernels.cpp_attention:CppPagedAttention",
}


def register_backend(name: str, target: str) -> None:
    """Register a backend by import path (`module:Class`), so its dependencies load only when chosen."""
    _REGISTRY[name] = target


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """`auto` is the compiled CPU kernel when it builds here, else the pure-torch backend."""
    if name == "auto":
        try:
            return get_attention_backend("cpp", device)
        except Exception as e:  # no compiler or ninja: the torch path computes the same thing
            warnings.warn(f"compiled CPU attention unavailable ({e}); using the torch backend", stacklevel=2)
            name = "torch"
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    module, cls = _REGISTRY[name].split(":")
    factory: Callable[[], AttentionBackend] = getattr(importlib.import_module(module), cls)
    return factory()
