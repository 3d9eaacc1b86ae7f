"""The CPU backend with compiled kernels that read K/V straight from the paged cache through the block
table (no gather copy). Single-token queries use a decode kernel, one task per request. In bfloat16 on
CPUs with AVX512-BF16, decodes and chunks both use `csrc_attention_bf16.cpp`; other dtypes run chunks
through the torch path's `chunk_attention` (masked SDPA) on the same decode/chunk split.

On CPUs with AMX, torch's flash attention runs its matmuls on the tiles, where the bfloat16 chunk kernel
tops out at the ~200 GFLOP/s of `vdpbf16ps`. There, bfloat16 steps whose chunks are all whole prompts of
one length (at least `FLASH_MIN_QUERY_LEN`) go through `F.scaled_dot_product_attention` with `is_causal`,
and a step of a single long chunk after a cached prefix through the torch path's masked SDPA; other steps
keep the kernel. A step with whole prompts of one length beside other chunks (a burst's prefill steps: the
budget cuts one prompt short, and decodes ride along) splits them: the prompts of the most common length go
to flash attention and the rest to the kernel. One layer of such a step (15 prompts of 128 tokens, one cut
to 42, 40 decodes) took 1.73 ms split against 2.55-2.67 in the kernel on the same host. Flash attention
and the masked SDPA gather the K/V they read from the cache first. On a 2-core Xeon with AMX (one
layer of SmolLM2-135M, 9 / 3 heads): 16 prompts of 128 tokens 2.24 -> 1.28 ms, one of 2,048 tokens 36.3 ->
7.4 ms, 512 tokens after 1,536 cached 15.6 -> 4.7 ms; 32 prompts of 64 tokens 1.41 -> 0.99 ms, but 64 of 32
tokens 0.94 -> 1.22, hence the lower bound.

The kernel is built with the other compiled CPU kernels (`kernels/cpu_extension.py`);
`get_attention_backend("auto")` falls back to the torch backend when the build is unavailable."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionMetadata, CommonAttentionMetadata
from kernels.cpu_attention import ChunkGroup, DecodeGroup, chunk_attention, chunk_subgroup, gather_kv, split_step
from kernels.cpu_extension import has_amx_bf16, load_extension, require_cpu

# The shortest prompt a chunk step goes to torch's flash attention with (on CPUs with AMX, bfloat16), and
# the shortest single chunk after a cached prefix that goes to the masked SDPA.
FLASH_MIN_QUERY_LEN = 64
MASKED_MIN_QUERY_LEN = 256


@dataclass(slots=True)
class CppAttentionMetadata(AttentionMetadata):
    """The compiled backend's step: where new K/V rows go, and the decode and chunk groups the kernels
    take (the chunk group also feeds the torch fallback, which builds its layout there on first use)."""

    slot_mapping: torch.Tensor  # [num_tokens]
    decodes: DecodeGroup | None
    chunks: ChunkGroup | None
    # on CPUs with AMX, where bfloat16 chunks go: "flash" (whole prompts of one length, `flash_chunks`;
    # `flash_rows` are their rows of the step, prompt by prompt, a slice when they follow each other),
    # "split" (those to flash attention, `kernel_chunks` the others to the kernel), "masked" (one long
    # chunk), or "kernel"
    chunk_path: str = "kernel"
    flash_rows: torch.Tensor | slice | None = None
    flash_chunks: ChunkGroup | None = None
    kernel_chunks: ChunkGroup | None = None


class CppPagedAttention(AttentionBackend[CppAttentionMetadata]):
    name = "cpp"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the cpp attention backend runs on the CPU, not {device}; use 'triton' or 'auto'")
        self._ext = load_extension()
        self._bf16 = self._ext.has_avx512_bf16()
        self._torch_chunks = self._bf16 and has_amx_bf16()  # torch's SDPA on the AMX tiles for some chunk steps

    def takes_bf16(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the compiled bfloat16 kernels run for `dtype` and `head_dim`: built for AVX512-BF16, and a
        head_dim that is a multiple of 32 and at most 256 (the decode kernel keeps head_dim / 16 sums of a
        head in registers)."""
        return self._bf16 and dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256

    def _use_bf16(self, query: torch.Tensor) -> bool:
        return self.takes_bf16(query.dtype, query.shape[-1])

    def build_metadata(self, common: CommonAttentionMetadata) -> CppAttentionMetadata:
        meta = CppAttentionMetadata(common.slot_mapping, *split_step(common))
        if self._torch_chunks and (ch := meta.chunks) is not None:
            whole = (ch.query_lens == ch.context_lens) & (ch.query_lens >= FLASH_MIN_QUERY_LEN)
            if bool(whole.any()):
                lens, counts = ch.query_lens[whole].unique(return_counts=True)
                n = int(lens[counts.argmax()])  # the most common whole-prompt length
                flash = whole & (ch.query_lens == n)
                if bool(flash.all()):
                    meta.chunk_path, meta.flash_chunks = "flash", ch
                else:
                    meta.chunk_path = "split"
                    meta.flash_chunks = chunk_subgroup(ch, flash, common.block_size)
                    meta.kernel_chunks = chunk_subgroup(ch, ~flash, common.block_size)
                starts = meta.flash_chunks.starts
                if bool((starts.diff() == n).all()):  # one run of rows: a view in, a copy out
                    meta.flash_rows = slice(int(starts[0]), int(starts[0]) + starts.numel() * n)
                else:
                    meta.flash_rows = (starts[:, None] + torch.arange(n, device=starts.device)).flatten()
            elif ch.starts.numel() == 1 and ch.max_query_len >= MASKED_MIN_QUERY_LEN:
                meta.chunk_path = "masked"
        return meta

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
            if not bf16 or meta.chunk_path == "masked":
                chunk_attention(query, k_cache, v_cache, ch, scale, out)
            else:
                if meta.chunk_path in ("flash", "split"):
                    flash_prompts(query, k_cache, v_cache, meta.flash_chunks, meta.flash_rows, scale, out)
                if meta.chunk_path in ("kernel", "split"):
                    kc = meta.kernel_chunks if meta.chunk_path == "split" else ch
                    self._ext.paged_prefill_attention_bf16_(out, query, k_cache, v_cache, kc.block_tables, kc.starts,
                                                            kc.query_lens, kc.context_lens, scale)
        return out


def flash_prompts(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: ChunkGroup,
                  rows: torch.Tensor | slice, scale: float, out: torch.Tensor) -> None:
    """Causal attention of whole prompts of one length (each chunk's context is its own query tokens) in one
    `F.scaled_dot_product_attention` call, written into their `rows` of `out` (indices, or a slice when they
    follow each other: 15 prompts of 128 tokens read 0.07 ms and wrote 0.19 ms a layer by index, 0 and 0.05
    by slice)."""
    r, n = chunks.starts.numel(), chunks.max_query_len
    _, h, d = query.shape
    q = query[rows].view(r, n, h, d).transpose(1, 2)
    k = gather_kv(k_cache, chunks.block_tables)[:, :, :n]
    v = gather_kv(v_cache, chunks.block_tables)[:, :, :n]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    out[rows] = o.transpose(1, 2).reshape(r * n, h, d)
