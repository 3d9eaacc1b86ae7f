"""The CPU backend with compiled kernels that read K/V straight from the paged cache through the block
table (no gather copy). Single-token queries use a decode kernel, one task per request. In bfloat16 on
CPUs with AVX512-BF16, decodes and chunks both use `csrc_attention_bf16.cpp`; other dtypes keep the
torch path (masked SDPA) for chunks.

The kernel is built with the other compiled CPU kernels (`kernels/cpu_extension.py`);
`get_attention_backend("auto")` falls back to the torch backend when the build is unavailable."""

from __future__ import annotations

import torch

from kernels.cpu_attention import TorchPagedAttention
from kernels.cpu_extension import load_extension


class CppPagedAttention(TorchPagedAttention):
    name = "cpp"

    def __init__(self) -> None:
        self._ext = load_extension()
        self._bf16 = self._ext.has_avx512_bf16()

    def _use_bf16(self, query: torch.Tensor) -> bool:
        return self._bf16 and query.dtype == torch.bfloat16 and query.shape[-1] % 32 == 0

    def write_kv(self, k_cache, v_cache, key, value, meta) -> None:
        self._ext.write_kv_(k_cache, v_cache, key, value, meta.slot_mapping)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, x: dict, scale: float) -> torch.Tensor:
        if self._use_bf16(q):
            return self._ext.paged_decode_attention_bf16(q, k_cache, v_cache, x["dec_tables"], x["dec_context_lens"], scale)
        return self._ext.paged_decode_attention(q, k_cache, v_cache, x["dec_tables"], x["dec_context_lens"], scale)

    def chunks(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, x: dict, scale: float,
               out: torch.Tensor) -> None:
        if not self._use_bf16(query):
            return super().chunks(query, k_cache, v_cache, x, scale, out)
        self._ext.paged_prefill_attention_bf16_(out, query, k_cache, v_cache, x["chunk_tables"], x["chunk_starts"],
                                                x["chunk_query_lens"], x["chunk_context_lens"], scale)
