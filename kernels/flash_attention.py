"""FlashAttention's paged kernel as an optional CUDA attention backend: `flash_attn_varlen_func` with a block
table, from the `flash_attn` package or vLLM's build of it (`vllm_flash_attn`). Neither is a dependency
(`flash-attn` builds against one torch and one CUDA; `vllm-flash-attn`'s only release pins torch 2.4), so
each is used only where it imports and passes a self-check on this device: `get_attention_backend` with an
`AttentionSpec` runs two small paged cases (prompt chunks beside decodes, then decodes alone; grouped heads)
through it and the torch backend and refuses it unless they agree; `auto` on CUDA tries these first, then
FlashInfer, then Triton. Upstream's decode-only steps go through its decode function, `flash_attn_with_kvcache`
(with the same block table), which splits long contexts across programs; vLLM's build, as vLLM does, takes
its varlen function for every step.

The caches keep the engine's layout, `[num_blocks, block_size, kv_heads, head_dim]`, which is FlashAttention's
paged layout. Upstream FlashAttention 2 takes blocks of a multiple of 256 tokens only (the engine's default is
16: the self-check refuses it there), vLLM's build any multiple of 16. Everything else is the Triton backend's:
its metadata (int64, CUDA-graph buffers included), its K/V store and fused layer input, so decode steps replay
CUDA graphs as with Triton. FlashAttention takes int32 block tables and cumulative lengths, made once per step
in `begin_step` (inside the graph when one is captured), and host bounds for the longest query and context:
the step's own in an eager step, one token and the block table's width in a graph."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels.attention import AttentionSpec, CommonAttentionMetadata
from kernels.attention_check import paged_difference
from kernels.triton_attention import TritonAttentionMetadata, TritonPagedAttention


@dataclass(slots=True)
class FlashAttnMetadata(TritonAttentionMetadata):
    """The Triton backend's metadata and, for an eager step, its longest query and context (host ints)."""

    max_query_len: int = 0
    max_seq_len: int = 0


class FlashAttnPagedAttention(TritonPagedAttention):
    """`flash_attn.flash_attn_varlen_func` over the paged caches (see the module docstring); decode-only steps
    through `flash_attn_with_kvcache`, the package's decode kernel (it splits each sequence's keys across
    programs when the batch is too small to fill the GPU)."""

    name = "flash_attn"
    module_names: tuple[str, ...] = ("flash_attn",)
    block_multiple = 256  # upstream FlashAttention 2's paged KV cache takes blocks of a multiple of 256 tokens
    dtypes = (torch.float16, torch.bfloat16)
    decode_kernel = "flash_attn_with_kvcache"  # the decode-only steps' function, where the package has it

    def __init__(self, device: torch.device | str = "cuda", module: ModuleType | None = None) -> None:
        """`module`: the package's module (default: the first of `module_names` that imports; tests give a
        stand-in, on the CPU under Triton's interpreter)."""
        super().__init__(device)
        self.fa = module if module is not None else _import_first(self.module_names)
        self.varlen = getattr(self.fa, "flash_attn_varlen_func")
        # each sequence's context as its length where the function takes that (vLLM's newer builds), else
        # as cumulative lengths (upstream's, and vLLM's 2.6 release)
        self.seqused = "seqused_k" in inspect.signature(self.varlen).parameters
        self.with_kvcache = getattr(self.fa, self.decode_kernel, None) if self.decode_kernel else None
        self._step: tuple | None = None  # (meta, int32 block tables, cumulative query and context lengths, lengths)

    def check(self, spec: AttentionSpec) -> None:
        """Raise ValueError unless this backend serves `spec`: its head_dim, then `check_package`."""
        if spec.head_dim % 8 or spec.head_dim > 256:
            raise ValueError(f"{self.name} needs a head_dim that is a multiple of 8 up to 256, got {spec.head_dim}")
        check_package(self, spec)

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        base = super().build_metadata(common)
        return FlashAttnMetadata(base.slot_mapping, base.block_tables, base.seq_lens, base.query_start_loc,
                                 int(common.query_lens.max()) if common.query_lens.numel() else 0,
                                 int(common.context_lens.max()) if common.context_lens.numel() else 0)

    def begin_step(self, meta: TritonAttentionMetadata) -> None:
        """The step's int32 block tables and cumulative lengths, once for all its layers."""
        seq_lens = meta.seq_lens.to(torch.int32)
        cu_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_k[1:])
        self._step = (meta, meta.block_tables.to(torch.int32), meta.query_start_loc.to(torch.int32), cu_k, seq_lens)

    def forward(self, query, k_cache, v_cache, meta: TritonAttentionMetadata, scale: float) -> torch.Tensor:
        if self._step is None or self._step[0] is not meta:
            self.begin_step(meta)
        _, tables, cu_q, cu_k, seq_lens = self._step
        num_tokens, num_seqs = query.shape[0], meta.seq_lens.shape[0]
        if num_tokens == num_seqs and self.with_kvcache is not None:  # decode-only: [batch, 1 query, heads, dim]
            out = self.with_kvcache(query.unsqueeze(1), k_cache, v_cache, cache_seqlens=seq_lens, block_table=tables,
                                    softmax_scale=scale, causal=True)
            return out.squeeze(1)
        if isinstance(meta, FlashAttnMetadata):
            max_q, max_k = meta.max_query_len, meta.max_seq_len
        else:  # a graph's buffers: decode steps, contexts up to the table's width
            max_q, max_k = (1 if num_tokens == num_seqs else num_tokens), tables.shape[1] * k_cache.shape[1]
        lengths = {"seqused_k": seq_lens} if self.seqused else {"cu_seqlens_k": cu_k}
        return self.varlen(q=query, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, max_seqlen_q=max_q, max_seqlen_k=max_k,
                           softmax_scale=scale, causal=True, block_table=tables, **lengths)


class VllmFlashAttnPagedAttention(FlashAttnPagedAttention):
    """vLLM's build of FlashAttention (the `vllm-flash-attn` package, or the one inside vLLM): blocks of any
    multiple of 16 tokens."""

    name = "vllm_flash_attn"
    module_names = ("vllm_flash_attn", "vllm.vllm_flash_attn")
    block_multiple = 16
    decode_kernel = ""  # vLLM calls its varlen function for every step, decodes included (it splits keys too)


def _import_first(names: tuple[str, ...]) -> ModuleType:
    """The first of `names` that imports (the last one's ImportError if none does)."""
    for name in names[:-1]:
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    return importlib.import_module(names[-1])


# the self-check's cases: (new tokens, context with them) per sequence: a prompt chunk, decodes, a chunk past a
# block; then a decode-only step (which a backend may run through another kernel)
SELF_CHECK_BATCHES = (((7, 7), (1, 41), (1, 2), (5, 305), (1, 258)), ((1, 41), (1, 2), (1, 258), (1, 17)))


def check_package(backend, spec: AttentionSpec, seed: int = 0) -> None:
    """An optional package's backend against `spec`: raise ValueError unless the block size is a multiple of
    its `block_multiple`, the dtype among its `dtypes` and the query heads whole groups, and unless it agrees
    with the torch backend to the dtype's rounding on `SELF_CHECK_BATCHES`, run through its own K/V store and
    attention in `spec`'s dtype, heads and block size (`attention_check.paged_difference`)."""
    if spec.block_size % backend.block_multiple:
        raise ValueError(f"{backend.name} needs a block size that is a multiple of {backend.block_multiple}, "
                         f"got {spec.block_size}")
    if spec.dtype not in backend.dtypes:
        names = " and ".join(str(d).removeprefix("torch.") for d in backend.dtypes)
        raise ValueError(f"{backend.name} runs {names}, not {spec.dtype}")
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"{backend.name} needs whole query groups, got {spec.num_heads} / {spec.num_kv_heads} heads")
    tolerance = 2e-2 if spec.dtype == torch.bfloat16 else 4e-3
    for batch in SELF_CHECK_BATCHES:
        diff = paged_difference(backend, backend.device, spec.dtype, spec.block_size, spec.num_heads,
                                spec.num_kv_heads, spec.head_dim, batch, seed)
        if not diff <= tolerance:  # (a NaN fails too)
            raise ValueError(f"{backend.name} failed its self-check: {diff:.3g} from the torch backend (tolerance "
                             f"{tolerance}) on {len(batch)} sequences of (new tokens, context) {batch}")
