"""The CPU backend with compiled kernels that read K/V straight from the paged cache through the block
table (no gather copy). Single-token queries use a decode kernel, one task per request. In bfloat16 on
CPUs with AVX512-BF16, decodes and chunks both use `csrc_attention_bf16.cpp`; other dtypes run chunks
through the torch path's `chunk_attention` (masked SDPA) on the same decode/chunk split.

The kernel is built with the other compiled CPU kernels (`kernels/cpu_extension.py`);
`get_attention_backend("auto")` falls back to the torch backend when the build is unavailable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend, AttentionMetadata, CommonAttentionMetadata
from kernels.cpu_attention import ChunkGroup, DecodeGroup, chunk_attention, split_step
from kernels.cpu_extension import load_extension, require_cpu


@dataclass(slots=True)
class CppAttentionMetadata(AttentionMetadata):
    """The compiled backend's step: where new K/V rows go, and the decode and chunk groups the kernels
    take (the chunk group also feeds the torch fallback, which builds its layout there on first use)."""

    slot_mapping: torch.Tensor  # [num_tokens]
    decodes: DecodeGroup | None
    chunks: ChunkGroup | None


class CppPagedAttention(AttentionBackend[CppAttentionMetadata]):
    name = "cpp"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the cpp attention backend runs on the CPU, not {device}; use 'triton' or 'auto'")
        self._ext = load_extension()
        self._bf16 = self._ext.has_avx512_bf16()

    def takes_bf16(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the compiled bfloat16 kernels run for `dtype` and `head_dim`: built for AVX512-BF16, and a
        head_dim that is a multiple of 32 and at most 256 (the decode kernel keeps head_dim / 16 sums of a
        head in registers)."""
        return self._bf16 and dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256

    def _use_bf16(self, query: torch.Tensor) -> bool:
        return self.takes_bf16(query.dtype, query.shape[-1])

    def build_metadata(self, common: CommonAttentionMetadata) -> CppAttentionMetadata:
        return CppAttentionMetadata(common.slot_mapping, *split_step(common))

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 meta: CppAttentionMetadata) -> None:
        require_cpu(k_cache, key)
        self._ext.write_kv_(k_cache, v_cache, key, value, meta.slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: CppAttentionMetadata,
                scale: float) -> torch.Tensor:
        require_cpu(query, k_cache)
        bf16 = self._use_bf16(query)
        if (dec := meta.decodes) is not None:
            kernel = self._ext.paged_decode_attention_bf16 if bf16 else self._ext.paged_decode_attention
            if meta.chunks is None:  # every row is a decode, in order: no gather, no scatter
                return kernel(query.contiguous(), k_cache, v_cache, dec.block_tables, dec.context_lens, scale)
        out = torch.empty_like(query)
        if dec is not None:
            out[dec.tokens] = kernel(query[dec.tokens], k_cache, v_cache, dec.block_tables, dec.context_lens, scale)
        if (ch := meta.chunks) is not None:
            if bf16:
                self._ext.paged_prefill_attention_bf16_(out, query, k_cache, v_cache, ch.block_tables, ch.starts,
                                                        ch.query_lens, ch.context_lens, scale)
            else:
                chunk_attention(query, k_cache, v_cache, ch, scale, out)
        return out
