"""Building a model runner from engine options: load the model (or this rank's shard of it), pick the
attention backend and layer ops, size the KV cache (profiling a step on a GPU) and allocate it.
The engine does this in its own process; under tensor parallelism each rank does it in its actor."""

from __future__ import annotations

import dataclasses
import logging

import torch

from kernels.attention import AttentionBackend, AttentionSpec, get_attention_backend
from kernels.layer_ops import CppLayerOps, get_layer_ops, packable
from workers.config import EngineConfig
from workers.model_loader import load_model
from workers.model_runner import ModelRunner
from workers.models.llama import LlamaForCausalLM, ModelArgs
from workers.sizing import gpu_kv_budget, num_kv_blocks
from workers.structured_output import StructuredOutputManager
from workers.tensor_parallel import Partition, TPShard

logger = logging.getLogger(__name__)


def build_model(config: EngineConfig, files: list[str], hf_config, dtype: torch.dtype, device: torch.device,
                max_model_len: int, tp: TPShard = TPShard()) -> tuple[LlamaForCausalLM, AttentionBackend]:
    model = load_model(files, hf_config, dtype, max_model_len, device, tp)
    spec = AttentionSpec(config.block_size, dtype, model.part.num_heads, model.part.num_kv_heads, model.args.head_dim)
    attn = get_attention_backend(config.attention_backend, device, spec)
    # The compiled layer ops come from the same build as the compiled attention: both or neither. On a GPU
    # the Triton attention (and FlashAttention's and FlashInfer's, which store K/V with it) comes with the
    # Triton layer ops (one kernel per norm, rotary and SiLU-and-mul; the fused norms and matmuls).
    if attn.triton_layer_ops and device.type == "cuda":
        from kernels.triton_layer_ops import TritonLayerOps

        model.ops = TritonLayerOps()
    else:
        model.ops = get_layer_ops("cpp" if attn.name == "cpp" else "torch")
    weights = model.linear_weights()
    if isinstance(model.ops, CppLayerOps) and should_prepack(config.prepack_weights, weights):
        packed = model.ops.prepack(weights)
        logger.info("prepacked the linear layers' weights: %.0f MiB more (--no-prepack-weights saves it)",
                    packed / 2**20)
    return model, attn


def should_prepack(option: bool | None, weights: list[torch.Tensor], memory_bytes: int | None = None,
                   available_bytes: int | None = None) -> bool:
    """`prepack_weights`: True or False as given. None (auto) packs when the two copies of the packable
    weights (`CppLayerOps.prepack`) fit in an eighth of the machine's memory and leave at least a quarter
    of it available: on a machine already filled by other replicas, a new one does without them (Ray's
    memory monitor kills workers past 95%)."""
    if option is not None:
        return option
    size = 2 * sum(w.nbytes for w in dict.fromkeys(weights) if packable(w))
    if memory_bytes is None or available_bytes is None:
        import psutil  # Ray's dependency

        memory = psutil.virtual_memory()
        memory_bytes = memory.total if memory_bytes is None else memory_bytes
        available_bytes = memory.available if available_bytes is None else available_bytes
    return 0 < size <= memory_bytes // 8 and available_bytes - size >= memory_bytes // 4


def profile_kv_budget(model: LlamaForCausalLM, attn: AttentionBackend, config: EngineConfig, dtype: torch.dtype,
                      device: torch.device, max_model_len: int) -> int:
    """Profile the largest step on a scratch cache and return the GPU bytes left for the KV cache."""
    n = min(config.max_num_batched_tokens, max_model_len)
    bs = config.block_size
    probe = ModelRunner(model, attn, -(-n // bs), bs, dtype, config.seed, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe.profile(n, min(n, config.max_num_seqs))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - probe.kv_cache.nbytes
    del probe
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return gpu_kv_budget(total, free, peak, config.gpu_memory_utilization)


def kv_blocks(config: EngineConfig, args: ModelArgs, part: Partition, dtype: torch.dtype, max_model_len: int,
              gpu_budget_bytes: int | None) -> int:
    """KV blocks of one cache holding `part`'s KV heads (every rank's cache has as many blocks)."""
    local = dataclasses.replace(args, num_kv_heads=part.num_kv_heads)
    return num_kv_blocks(config, local, dtype, max_model_len, gpu_budget_bytes)


def make_runner(model: LlamaForCausalLM, attn: AttentionBackend, config: EngineConfig, num_blocks: int,
                dtype: torch.dtype, device: torch.device, max_model_len: int,
                structured: StructuredOutputManager | None = None) -> ModelRunner:
    runner = ModelRunner(model, attn, num_blocks, config.block_size, dtype, config.seed, device, structured)
    # CUDA graphs capture one process's kernels; a tensor-parallel step's collectives run eagerly
    if device.type == "cuda" and not config.enforce_eager and attn.graph_safe and model.tp.size == 1:
        runner.enable_decode_graphs(config.max_num_seqs, max_model_len)
    return runner
