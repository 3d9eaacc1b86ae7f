"""Engine configuration: vLLM's option names, each with a help string, validated on construction."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from workers.request_queue import SchedulingPolicy

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30}


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MiB', '1.5g'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {value!r}; use bytes or e.g. '2GiB', '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    model: str | None = _opt(None, "Path to a Hugging Face model folder (Llama family); default: SmolLM2-135M-Instruct.")
    dtype: str = _opt("auto", "Weights and KV cache dtype: auto, bfloat16, float16 or float32. auto: bfloat16 on a "
                              "GPU that has it (else float16) and on a CPU whose oneDNN runs it (AVX-512 or AMX), "
                              "float32 on other CPUs (AVX2 only), where bfloat16 matmuls are several times slower.")
    max_model_len: int | None = _opt(None, "Longest prompt + output in tokens; default: the model's maximum, capped at 8192.")
    max_num_seqs: int = _opt(256, "Most sequences running in one step.")
    max_num_batched_tokens: int = _opt(2048, "Token budget of one step (prefill chunks plus decodes).")
    block_size: int = _opt(16, "Tokens per KV cache block.")
    num_kv_blocks: int | None = _opt(None, "KV cache size in blocks (overrides --kv-cache-memory).")
    kv_cache_memory: int | str | None = _opt(
        None, "KV cache size as memory, e.g. 2GiB; the block count follows from the model's shape; default: 2GiB "
              "on the CPU, on a GPU, what --gpu-memory-utilization leaves after the weights and a profiling step.")
    scheduling_policy: str = _opt(SchedulingPolicy.FCFS.value,
                                  f"Waiting-queue order: {', '.join(SchedulingPolicy.names())}.")
    length_predictor: str | None = _opt(
        None, f"JSON file of a trained output-length predictor for --scheduling-policy {SchedulingPolicy.PREDICTED.value} "
              "(kvrelay bench train-predictor writes one); default: a running mean of finished lengths.")
    enable_prefix_caching: bool = _opt(True, "Reuse KV blocks of identical prompt prefixes.")
    enable_chunked_prefill: bool = _opt(True, "Split long prompts across steps; off runs each prompt whole (budget >= max_model_len).")
    attention_backend: str = _opt("auto", "Attention kernel: auto (compiled on the CPU; on CUDA FlashAttention or "
                                          "FlashInfer where vllm_flash_attn, flash_attn or flashinfer is installed "
                                          "and passes its self-check, else triton), torch, cpp, triton, flash_attn, "
                                          "vllm_flash_attn or flashinfer.")
    device: str = _opt("auto", "Where the model and KV cache live: auto (CUDA when available), cpu, cuda or cuda:N.")
    gpu_memory_utilization: float = _opt(
        0.9, "CUDA only: the fraction of the GPU's memory the engine may use (weights, activations, KV cache).")
    enforce_eager: bool = _opt(False, "CUDA only: never capture CUDA graphs (decode steps run eagerly).")
    disable_async_output_proc: bool = _opt(
        False, "CUDA only: make a step's outputs (text, stop strings, logprobs) before the next step starts, "
               "instead of while the GPU runs it (one GPU: on by default; each output then comes one step later).")
    async_scheduling: bool | None = _opt(
        None, "Queue each decode step on the device behind the one it is running, before that step's tokens are "
              "known (the next step's inputs are its sampled ids, read on the device), so the host's work for a "
              "step overlaps the device's; a request a step ends computes one token more, dropped. Decode steps "
              "without drafts only (under a grammar, the forward pass; with "
              "speculation: while more requests run than speculative_disable_by_batch_size, which it then needs); "
              "not with tensor parallelism; default: on for one GPU without speculation or with that limit.")
    tensor_parallel_size: int = _opt(1, "Split every layer over this many ranks (Ray actors joined by gloo on the "
                                        "CPU, NCCL on CUDA), one bundle each in the replica's placement group.")
    distributed_timeout_s: float = _opt(300.0, "Tensor parallelism: a step that a rank has not finished within this "
                                               "long fails, and the ranks are taken as lost (the replica turns "
                                               "unhealthy).")
    num_threads: int | None = _opt(None, "torch threads for the engine (split among tensor-parallel ranks); "
                                         "default: all cores.")
    prepack_weights: bool | None = _opt(None, "CPU, bfloat16: keep two more copies of the linear layers' weights, "
                                              "one in the decode GEMV's own layout (25-65% faster at 16-32 rows) "
                                              "and one in oneDNN's blocked layout for larger steps (the same bits, "
                                              "5-25% faster), at twice the weights' memory; default: on when "
                                              "both fit in an eighth of the machine's memory and leave a quarter "
                                              "of it available.")
    seed: int = _opt(0, "Seed of the shared sampling generator (requests with their own seed ignore it).")
    stream_interval: int = _opt(1, "Streamed requests: send a request's first token at once, then its new tokens "
                                   "every this many (and the rest with its end); fewer, larger chunks cost the "
                                   "HTTP path less per token.")
    num_speculative_tokens: int = _opt(4, "Greedy requests: draft up to this many tokens a step by n-gram prompt lookup "
                                          "(vLLM's speculative method 'ngram') and keep those the model agrees "
                                          "with; the same tokens as without, in fewer steps; 0: off.")
    prompt_lookup_max: int = _opt(4, "Speculation: the longest suffix (in tokens) looked up in the sequence.")
    prompt_lookup_min: int = _opt(2, "Speculation: the shortest suffix (in tokens) looked up in the sequence.")
    speculative_disable_by_batch_size: int | None = _opt(
        None, "Speculation: no drafts in a step while more requests than this run; default: no limit on the CPU "
              "(beside other requests, each drafts only the tokens its record of kept drafts says are kept with "
              "at least the odds a row costs, by the engine's timed steps), and "
              "where decode steps replay CUDA graphs as many as the largest graph holds with all their drafts, "
              "max_num_seqs // (1 + num_speculative_tokens) (a step of more rows would run eagerly).")

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "speculative_disable_by_batch_size"):
            value = getattr(self, name)
            if value is None and name == "speculative_disable_by_batch_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size", "stream_interval",
                     "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None and parse_memory(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if self.scheduling_policy not in SchedulingPolicy.names():
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}; "
                             f"choose one of {', '.join(SchedulingPolicy.names())}")
        if self.length_predictor is not None and self.scheduling_policy != SchedulingPolicy.PREDICTED.value:
            raise ValueError(f"length_predictor is only used by scheduling_policy {SchedulingPolicy.PREDICTED.value!r}, "
                             f"not {self.scheduling_policy!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.distributed_timeout_s, (int, float)) or self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s!r}")
        if not isinstance(self.dtype, str) and str(self.dtype) in ("torch.bfloat16", "torch.float16", "torch.float32"):
            self.dtype = str(self.dtype).removeprefix("torch.")  # a torch dtype, as vLLM takes one too
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r} names one GPU, but with tensor_parallel_size "
                             f"{self.tensor_parallel_size} Ray gives each rank its own; use device cuda")
        if self.async_scheduling and self.speculative_disable_by_batch_size is None and (
                self.device == "cpu" or self.enforce_eager or self.tensor_parallel_size > 1):
            # no CUDA graphs, so no default limit (`default_speculation_limit`); elsewhere the engine checks
            check_async_speculation(self.async_scheduling, self.num_speculative_tokens, None)
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling does not run with tensor_parallel_size > 1")
        if self.num_threads is None:
            self.num_threads = os.cpu_count() or 1


def default_speculation_limit(config: EngineConfig, graph_batch: int | None) -> int | None:
    """`speculative_disable_by_batch_size`, or by default, where decode steps replay CUDA graphs of up to
    `graph_batch` rows, the most requests whose drafts all fit the largest graph (each draft is a row of the
    step): a step of more rows runs eagerly (a batch-256 decode step took 29 ms on an H200 against 4.9 replaying
    its graph, docs/benchmarks.md), so above that steps draft nothing and, with async scheduling, run ahead."""
    if config.speculative_disable_by_batch_size is not None or not config.num_speculative_tokens or graph_batch is None:
        return config.speculative_disable_by_batch_size
    return max(1, graph_batch // (1 + config.num_speculative_tokens))


def check_async_speculation(async_scheduling: bool | None, num_speculative_tokens: int, limit: int | None) -> None:
    if async_scheduling and num_speculative_tokens and limit is None:
        raise ValueError("async_scheduling runs steps ahead only when they have no drafts: with speculation "
                         "(num_speculative_tokens), set speculative_disable_by_batch_size (steps of more "
                         "requests then run ahead), or num_speculative_tokens to 0, or async_scheduling off")
