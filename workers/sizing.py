"""How long a sequence may be and how many KV blocks the engine gets, from its options and the model."""

from __future__ import annotations

import torch

from workers.config import EngineConfig, parse_memory
from workers.models.llama import ModelArgs

_MAX_DEFAULT_LEN = 8192


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    """`max_model_len`, or the model's maximum capped at 8192; checked against the model and the budget."""
    model_max = getattr(hf_config, "max_position_embeddings", _MAX_DEFAULT_LEN)
    max_model_len = config.max_model_len or min(model_max, _MAX_DEFAULT_LEN)
    if max_model_len > model_max:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {model_max}")
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(f"with chunked prefill off, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                         f"must be >= max_model_len ({max_model_len}); lower max_model_len or raise the budget")
    return max_model_len


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * elem


def num_kv_blocks(config: EngineConfig, args: ModelArgs, dtype: torch.dtype, max_model_len: int) -> int:
    """`num_kv_blocks`, or as many blocks as `kv_cache_memory` holds; at least one full sequence's worth."""
    blocks = config.num_kv_blocks or parse_memory(config.kv_cache_memory) // kv_bytes_per_block(
        args, config.block_size, dtype)
    if blocks * config.block_size < max_model_len:
        raise ValueError(f"the KV cache holds {blocks * config.block_size} tokens ({blocks} blocks of "
                         f"{config.block_size}), fewer than max_model_len {max_model_len}; "
                         "enlarge the cache or lower max_model_len")
    return blocks
