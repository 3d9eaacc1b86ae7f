"""Attention over the paged KV cache. One interface, backends chosen by name at run time."""

from kernels.attention import (AttentionBackend, AttentionMetadata, CommonAttentionMetadata, available_backends,
                               get_attention_backend)

__all__ = ["AttentionBackend", "AttentionMetadata", "CommonAttentionMetadata", "available_backends",
           "get_attention_backend"]
