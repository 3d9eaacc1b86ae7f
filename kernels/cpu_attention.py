"""Paged attention in plain torch, vectorised across the batch.

Requests are split into two groups once per step (`split_step`): decodes (one query token) and chunks
(several). Each group gathers its requests' blocks into a padded `[batch, kv_heads, ctx, head_dim]` view
and runs one masked `scaled_dot_product_attention`. GQA is folded into the query axis (the query heads
that share a KV head become extra query rows), so no key/value is ever repeated. The group types and the
attention functions are plain, so the compiled backend shares them for its fallback path."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionMetadata, CommonAttentionMetadata


@dataclass(slots=True)
class ChunkLayout:
    """The torch chunk path's padded `[chunks, max_query]` view of the flat batch and its causal mask."""

    tokens: torch.Tensor  # [chunks, max_query] row of each query in the batch (0 where padded)
    valid: torch.Tensor  # [chunks, max_query] which entries are real queries
    valid_tokens: torch.Tensor  # tokens[valid]
    mask: torch.Tensor  # [chunks, 1, max_query * group, keys]


@dataclass(slots=True)
class DecodeGroup:
    """The step's requests with a single query token. `mask` is the torch path's, built on first use."""

    tokens: torch.Tensor  # [decodes] row of each decode's query in the batch
    context_lens: torch.Tensor  # [decodes]
    block_tables: torch.Tensor  # [decodes, blocks of the longest context], contiguous
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class ChunkGroup:
    """The step's requests with several query tokens. `layout` is the torch path's, built on first use."""

    starts: torch.Tensor  # [chunks] row of each chunk's first query in the batch
    query_lens: torch.Tensor  # [chunks]
    context_lens: torch.Tensor  # [chunks]
    block_tables: torch.Tensor  # [chunks, blocks of the longest context], contiguous
    max_query_len: int  # read on the host, so building the layout never waits for a device
    layout: ChunkLayout | None = None


def split_step(common: CommonAttentionMetadata) -> tuple[DecodeGroup | None, ChunkGroup | None]:
    """The decodes and the chunks of a step (None for an empty group), each with its block tables cut to
    the blocks its longest context uses."""
    bs, starts = common.block_size, common.query_start_loc[:-1]
    is_decode = common.query_lens == 1
    decodes = chunks = None
    if bool(is_decode.any()):
        idx = is_decode.nonzero().squeeze(1)
        ctx = common.context_lens[idx]
        nb = int((ctx.max() + bs - 1) // bs)
        decodes = DecodeGroup(starts[idx], ctx, common.block_tables[idx, :nb].contiguous())
    is_chunk = ~is_decode
    if bool(is_chunk.any()):
        chunks = _select_chunks(starts, common.query_lens, common.context_lens, common.block_tables, is_chunk, bs)
    return decodes, chunks


def chunk_subgroup(chunks: ChunkGroup, keep: torch.Tensor, block_size: int) -> ChunkGroup:
    """The chunks where the boolean `keep` is set, their block tables cut to the blocks they use."""
    return _select_chunks(chunks.starts, chunks.query_lens, chunks.context_lens, chunks.block_tables, keep, block_size)


def _select_chunks(starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                   block_tables: torch.Tensor, keep: torch.Tensor, block_size: int) -> ChunkGroup:
    idx = keep.nonzero().squeeze(1)
    ctx, qlen = context_lens[idx], query_lens[idx]
    nb = int((ctx.max() + block_size - 1) // block_size)
    return ChunkGroup(starts[idx], qlen, ctx, block_tables[idx, :nb].contiguous(), int(qlen.max()))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] gathered by [b, nb] -> [b, kvh, nb*bs, d]."""
    b, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache.index_select(0, block_tables.flatten()).view(b, nb * bs, kvh, d).transpose(1, 2)


def _chunk_layout(chunks: ChunkGroup, block_size: int, group: int) -> ChunkLayout:
    qlen, ctx = chunks.query_lens, chunks.context_lens
    max_q = chunks.max_query_len
    dev = qlen.device
    key_pos = torch.arange(chunks.block_tables.shape[1] * block_size, device=dev)
    qi = torch.arange(max_q, device=dev)
    valid = qi[None, :] < qlen[:, None]  # [chunks, max_q]
    tokens = torch.where(valid, chunks.starts[:, None] + qi[None, :], 0)
    q_pos = (ctx - qlen)[:, None] + qi[None, :]  # absolute position of each query row
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    mask[:, :, 0] |= ~valid  # padded rows see one key: no NaN, result discarded
    return ChunkLayout(tokens, valid, tokens[valid], mask.repeat_interleave(group, dim=1)[:, None])


def chunk_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: ChunkGroup,
                    scale: float, out: torch.Tensor) -> None:
    """Attention for the chunks' queries (rows of the flat `query`), written into their rows of `out`.
    Builds `chunks.layout` on the first layer of a step; later layers reuse it."""
    _, h, d = query.shape
    kvh = k_cache.shape[2]
    g = h // kvh
    if chunks.layout is None:
        chunks.layout = _chunk_layout(chunks, k_cache.shape[1], g)
    lay = chunks.layout
    bp, max_q = lay.tokens.shape
    q = query[lay.tokens].view(bp, max_q, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(bp, kvh, max_q * g, d)
    k = gather_kv(k_cache, chunks.block_tables)
    v = gather_kv(v_cache, chunks.block_tables)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=lay.mask, scale=scale)
    o = o.view(bp, kvh, max_q, g, d).permute(0, 2, 1, 3, 4).reshape(bp, max_q, h, d)
    out[lay.valid_tokens] = o[lay.valid]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decodes: DecodeGroup,
                     scale: float) -> torch.Tensor:
    """Attention for the decodes' queries `q` ([decodes, heads, head_dim]). Builds `decodes.mask` on the
    first layer of a step; later layers reuse it."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    if decodes.mask is None:
        key_pos = torch.arange(decodes.block_tables.shape[1] * k_cache.shape[1], device=q.device)
        decodes.mask = (key_pos[None, :] < decodes.context_lens[:, None])[:, None, None, :]
    k = gather_kv(k_cache, decodes.block_tables)
    v = gather_kv(v_cache, decodes.block_tables)
    o = F.scaled_dot_product_attention(q.view(b, kvh, h // kvh, d), k, v, attn_mask=decodes.mask, scale=scale)
    return o.reshape(b, h, d)


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The torch backend's step: where new K/V rows go, and the decode and chunk groups."""

    slot_mapping: torch.Tensor  # [num_tokens]
    decodes: DecodeGroup | None
    chunks: ChunkGroup | None


def _on(group, device: torch.device):
    """`group` (a DecodeGroup or ChunkGroup, or None) with its tensors on `device`."""
    if group is None or device.type == "cpu":
        return group
    return dataclasses.replace(group, **{f.name: getattr(group, f.name).to(device, non_blocking=True)
                                         for f in dataclasses.fields(group)
                                         if isinstance(getattr(group, f.name), torch.Tensor)})


class TorchPagedAttention(AttentionBackend[TorchAttentionMetadata]):
    """Plain torch on any device: the CPU fallback, and the reference the other backends are tested against."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        decodes, chunks = split_step(common)
        return TorchAttentionMetadata(common.slot_mapping.to(self.device, non_blocking=True),
                                      _on(decodes, self.device), _on(chunks, self.device))

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 meta: TorchAttentionMetadata) -> None:
        nkv, d = key.shape[-2:]
        k_cache.view(-1, nkv, d).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, nkv, d).index_copy_(0, meta.slot_mapping, value)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchAttentionMetadata,
                scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        if meta.decodes is not None:
            tok = meta.decodes.tokens
            out[tok] = decode_attention(query[tok], k_cache, v_cache, meta.decodes, scale)
        if meta.chunks is not None:
            chunk_attention(query, k_cache, v_cache, meta.chunks, scale, out)
        return out
