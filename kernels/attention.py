"""The attention-backend interface and its registry.

The model runner describes each step once, backend-independently (`CommonAttentionMetadata`); the chosen
backend's `build_metadata` turns that into its own metadata type, which then serves every layer:
`write_kv` stores the step's new keys/values into their slots, `forward` attends each new token to its
own request's cached context. KV caches are `[num_blocks, block_size, num_kv_heads, head_dim]` per layer.
Backends are registered by import path, so a GPU backend's libraries load only when it is chosen."""

from __future__ import annotations

import importlib
import logging
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What a model's attention asks of a backend: what an optional package's self-check runs
    (`AttentionBackend.check`)."""

    block_size: int
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(slots=True)
class CommonAttentionMetadata:
    """One step as the model runner lays it out, the same for every backend. Each request's new tokens
    are contiguous in the flat batch and in request order. Tensors are on the CPU."""

    query_lens: torch.Tensor  # [num_reqs] new tokens this step
    query_start_loc: torch.Tensor  # [num_reqs + 1] offset of each request's first new token; last = num_tokens
    context_lens: torch.Tensor  # [num_reqs] cached tokens plus this step's
    block_tables: torch.Tensor  # [num_reqs, max_blocks] block ids, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each new token (block_id * block_size + offset)
    block_size: int
    num_heads: int
    num_kv_heads: int


class AttentionMetadata:
    """Base of every backend's per-step metadata. Only the backend that built it reads it; the model
    passes it through to each layer."""

    __slots__ = ()


M = TypeVar("M", bound=AttentionMetadata)


class AttentionBackend(ABC, Generic[M]):
    name: str = ""
    graph_safe = False  # its steps may be captured in a CUDA graph (its metadata: `TritonAttentionMetadata`)
    triton_layer_ops = False  # on CUDA the model takes the Triton layer ops with it

    def check(self, spec: AttentionSpec) -> None:
        """Raise ValueError unless this backend serves `spec` (an optional package's self-check); nothing to
        check by default."""

    def begin_step(self, meta: M) -> None:
        """Called by the model once per forward pass, before its layers (inside a CUDA graph's capture when
        one is captured): per-step work the layers then share. Nothing by default."""

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> M:
        """Precompute, once per step, what `write_kv` and `forward` need in every layer."""

    def graph_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor) -> M:
        """A graph-safe backend's metadata for a CUDA graph of decode steps, over the graph's static int64
        device buffers (`workers/cuda_graphs.py`)."""
        raise NotImplementedError(f"{self.name} attention is not captured in CUDA graphs")

    def prepare_graph_step(self, meta: M, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           block_size: int) -> None:
        """Host work before a graph's step replays (and before its capture), given the padded step's context
        lengths and block tables on the host (`graph_metadata`'s buffers already hold them on the device).
        Nothing by default."""

    @abstractmethod
    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 meta: M) -> None:
        """Store `key`/`value` ([num_tokens, num_kv_heads, head_dim]) into their slots."""

    def rope_and_write_kv(self, qk: torch.Tensor, value: torch.Tensor, rope: tuple, ops, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: M) -> None:
        """Rotate the step's queries and keys in place (`qk`: [num_tokens, num_heads + num_kv_heads, head_dim],
        the keys last; `rope`: the cos and sin tables and each token's position) with the layer ops' `rope_`,
        then store the keys and `value` into their slots. A backend may do both in one kernel."""
        ops.rope_(qk, *rope)
        self.write_kv(k_cache, v_cache, qk[:, qk.shape[1] - value.shape[1]:], value, meta)

    def project_qkv(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int, num_kv_heads: int, rope: tuple,
                    ops, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: M) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's input: `x + residual` (`x` alone without one) and the q/k/v projection of its RMSNorm
        (`ops.norm_linear`), the queries and keys rotated and the keys and values stored into their slots
        (`rope_and_write_kv`). Returns the residual stream and the queries ([num_tokens, num_heads, head_dim]).
        A backend may do it all in one kernel."""
        x, qkv = ops.norm_linear(x, residual, norm_weight, eps, weight, bias)
        t, width = qkv.shape
        d = width // (num_heads + 2 * num_kv_heads)
        qk = qkv[:, : (num_heads + num_kv_heads) * d].view(t, num_heads + num_kv_heads, d)
        v = qkv[:, (num_heads + num_kv_heads) * d:].view(t, num_kv_heads, d)
        self.rope_and_write_kv(qk, v, rope, ops, k_cache, v_cache, meta)
        return x, qk[:, :num_heads]

    @abstractmethod
    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: M,
                scale: float) -> torch.Tensor:
        """Causal attention of `query` ([num_tokens, num_heads, head_dim]) over each request's context
        (cached tokens plus this step's); returns the same shape."""


_REGISTRY: dict[str, str] = {
    "torch": "kernels.cpu_attention:TorchPagedAttention",
    "cpp": "kernels.cpp_attention:CppPagedAttention",
    "triton": "kernels.triton_attention:TritonPagedAttention",
    "flash_attn": "kernels.flash_attention:FlashAttnPagedAttention",
    "vllm_flash_attn": "kernels.flash_attention:VllmFlashAttnPagedAttention",
    "flashinfer": "kernels.flashinfer_attention:FlashInferPagedAttention",
}
# What `auto` tries, in order, before falling back to the torch backend; the optional packages' (not
# dependencies: `kernels/flash_attention.py`, `kernels/flashinfer_attention.py`) are passed over quietly
# when they do not import or pass.
_AUTO = {"cpu": ("cpp",), "cuda": ("vllm_flash_attn", "flash_attn", "flashinfer", "triton")}
_OPTIONAL = frozenset({"vllm_flash_attn", "flash_attn", "flashinfer"})


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu",
                          spec: AttentionSpec | None = None) -> AttentionBackend:
    """The backend `name` for tensors on `device`, checked against `spec` when given (`AttentionBackend.check`:
    ValueError if it does not serve it). `auto`: on the CPU the compiled kernels when they build here; on CUDA
    FlashAttention (vLLM's build, then upstream's), then FlashInfer, where the package imports and passes its
    self-check, else the Triton kernels; else the pure-torch backend, which runs anywhere."""
    device = torch.device(device)
    if name == "auto":
        for candidate in _AUTO.get(device.type, ()):
            try:
                return get_attention_backend(candidate, device, spec)
            except Exception as e:  # no package, no compiler, no triton: the next computes the same thing
                if candidate in _OPTIONAL:
                    logger.debug("%s attention not used: %s", candidate, e)
                else:
                    warnings.warn(f"{candidate} attention unavailable ({e}); trying the next backend", stacklevel=2)
        name = "torch"
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(available_backends())}")
    module, cls = _REGISTRY[name].split(":")
    factory: Callable[[torch.device], AttentionBackend] = getattr(importlib.import_module(module), cls)
    backend = factory(device)
    if spec is not None:
        backend.check(spec)
    return backend
