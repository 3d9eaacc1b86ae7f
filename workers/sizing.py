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


_DEFAULT_CPU_KV_MEMORY = 2 << 30


def resolve_device(name: str) -> torch.device:
    """`auto` is the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but torch sees no CUDA device here")
    return device


def wants_gpus(device: str) -> bool:
    """Whether a `device` option asks for GPUs (`auto`: where this process sees one)."""
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def dtype_device(config) -> torch.device:
    """The kind of device whose `auto` dtype an engine takes (`model_loader.auto_dtype`): CUDA where `device` asks
    for GPUs (as `TPModelRunner` does for its ranks), even where this process has none (a GPU pool's engine, read
    by an app's config elsewhere); else its own device, or with tensor parallelism the CPU its ranks run on."""
    if wants_gpus(config.device):
        return torch.device("cuda")
    return resolve_device(config.device) if config.tensor_parallel_size == 1 else torch.device("cpu")


def gpu_kv_budget(total_bytes: int, free_bytes: int, peak_bytes: int, utilization: float) -> int:
    """Bytes left for the KV cache on a GPU: `utilization` of its memory, less what this engine's weights
    and its largest step took at their peak (profiled), and never more than is free now (another engine
    may share the GPU)."""
    budget = min(int(total_bytes * utilization) - peak_bytes, free_bytes - (total_bytes - free_bytes) // 100)
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: {utilization:.0%} of {total_bytes / 2**30:.1f} GiB "
                         f"is {total_bytes * utilization / 2**30:.1f} GiB, the model and a full step peak at "
                         f"{peak_bytes / 2**30:.1f} GiB and {free_bytes / 2**30:.1f} GiB is free; raise "
                         "gpu_memory_utilization or lower max_num_batched_tokens")
    return budget


def num_kv_blocks(config: EngineConfig, args: ModelArgs, dtype: torch.dtype, max_model_len: int,
                  gpu_budget_bytes: int | None = None) -> int:
    """`num_kv_blocks`, or as many blocks as `kv_cache_memory` holds, or (on a GPU, when neither is set)
    as `gpu_budget_bytes` holds, else 2 GiB's worth; at least one full sequence's worth."""
    per_block = kv_bytes_per_block(args, config.block_size, dtype)
    if config.num_kv_blocks:
        blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None:
        blocks = parse_memory(config.kv_cache_memory) // per_block
    else:
        blocks = (gpu_budget_bytes if gpu_budget_bytes is not None else _DEFAULT_CPU_KV_MEMORY) // per_block
    if blocks * config.block_size < max_model_len:
        raise ValueError(f"the KV cache holds {blocks * config.block_size} tokens ({blocks} blocks of "
                         f"{config.block_size}), fewer than max_model_len {max_model_len}; "
                         "enlarge the cache or lower max_model_len")
    return blocks
