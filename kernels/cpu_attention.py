"""Paged attention in plain torch, vectorised across the batch.

Requests are split into two groups once per step: decodes (one query token) and chunks (several). Each
group gathers its requests' blocks into a padded `[batch, kv_heads, ctx, head_dim]` view and runs one
masked `scaled_dot_product_attention`. GQA is folded into the query axis (the query heads that share a
KV head become extra query rows), so no key/value is ever repeated."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionMetadata


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] gathered by [b, nb] -> [b, kvh, nb*bs, d]."""
    b, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache.index_select(0, block_tables.flatten()).view(b, nb * bs, kvh, d).transpose(1, 2)


def _chunk_layout(x: dict) -> None:
    """The padded [chunks, max_query] token index and causal mask of the torch chunk path, built once per
    step on first use (the compiled bfloat16 kernel needs neither)."""
    qlen, ctx, starts = x["chunk_query_lens"], x["chunk_context_lens"], x["chunk_starts"]
    max_q = int(qlen.max())
    key_pos = torch.arange(x["chunk_tables"].shape[1] * x["block_size"])
    qi = torch.arange(max_q)
    valid = qi[None, :] < qlen[:, None]  # [bp, max_q]
    tokens = torch.where(valid, starts[:, None] + qi[None, :], 0)
    q_pos = (ctx - qlen)[:, None] + qi[None, :]  # absolute position of each query row
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    mask[:, :, 0] |= ~valid  # padded rows see one key: no NaN, result discarded
    x["chunk_tokens"] = tokens
    x["chunk_valid"] = valid
    x["chunk_valid_tokens"] = tokens[valid]
    x["chunk_mask"] = mask.repeat_interleave(x["group"], dim=1)[:, None]


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def build_metadata(self, query_lens, context_lens, block_tables, slot_mapping, block_size, num_heads, num_kv_heads):
        group = num_heads // num_kv_heads
        starts = torch.cumsum(query_lens, 0) - query_lens
        extra: dict = {"group": group}

        is_decode = query_lens == 1
        if bool(is_decode.any()):
            idx = is_decode.nonzero().squeeze(1)
            ctx = context_lens[idx]
            nb = int((ctx.max() + block_size - 1) // block_size)
            extra["dec_tokens"] = starts[idx]
            extra["dec_context_lens"] = ctx
            extra["dec_tables"] = block_tables[idx, :nb].contiguous()
            extra["block_size"] = block_size

        is_chunk = ~is_decode
        if bool(is_chunk.any()):
            idx = is_chunk.nonzero().squeeze(1)
            ctx = context_lens[idx]
            nb = int((ctx.max() + block_size - 1) // block_size)
            extra["chunk_starts"] = starts[idx]
            extra["chunk_query_lens"] = query_lens[idx]
            extra["chunk_context_lens"] = ctx
            extra["chunk_tables"] = block_tables[idx, :nb].contiguous()
            extra["block_size"] = block_size
        return AttentionMetadata(slot_mapping, query_lens, context_lens, block_tables, extra)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        x = meta.extra
        out = torch.empty_like(query)
        if "dec_tokens" in x:
            tok = x["dec_tokens"]
            out[tok] = self.decode(query[tok], k_cache, v_cache, x, scale)
        if "chunk_starts" in x:
            self.chunks(query, k_cache, v_cache, x, scale, out)
        return out

    def chunks(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, x: dict, scale: float,
               out: torch.Tensor) -> None:
        """Attention for the requests with several query tokens, written into their rows of `out`."""
        if "chunk_mask" not in x:
            _chunk_layout(x)
        _, h, d = query.shape
        g = x["group"]
        kvh = h // g
        tok = x["chunk_tokens"]
        bp, max_q = tok.shape
        q = query[tok].view(bp, max_q, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(bp, kvh, max_q * g, d)
        k = _gather_kv(k_cache, x["chunk_tables"])
        v = _gather_kv(v_cache, x["chunk_tables"])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=x["chunk_mask"], scale=scale)
        o = o.view(bp, kvh, max_q, g, d).permute(0, 2, 1, 3, 4).reshape(bp, max_q, h, d)
        out[x["chunk_valid_tokens"]] = o[x["chunk_valid"]]

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, x: dict, scale: float) -> torch.Tensor:
        """Attention for single-token queries `q` ([decodes, heads, head_dim])."""
        b, h, d = q.shape
        g = x["group"]
        if "dec_mask" not in x:  # built once per step on first use (the compiled kernels need none)
            key_pos = torch.arange(x["dec_tables"].shape[1] * x["block_size"])
            x["dec_mask"] = (key_pos[None, :] < x["dec_context_lens"][:, None])[:, None, None, :]
        k = _gather_kv(k_cache, x["dec_tables"])
        v = _gather_kv(v_cache, x["dec_tables"])
        o = F.scaled_dot_product_attention(q.view(b, h // g, g, d), k, v, attn_mask=x["dec_mask"], scale=scale)
        return o.reshape(b, h, d)
