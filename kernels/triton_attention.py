"""Paged attention in Triton: one kernel for decodes and prefill chunks alike, and the backend that also
writes each step's keys and values (`kernels/triton_kv_write.py`).

The attention grid is fixed by the batch's token and sequence counts, not by its contents: program `(i, h)`
finds its sequence inside the kernel (a binary search over the query start offsets), so the same launch
serves any mix of decodes and chunks and can be captured in a CUDA graph; a decode step (one token per
sequence, known from the shapes) launches one program per sequence and KV head, with no search. Each program
takes a tile of up to `BLOCK_Q` query tokens of one sequence times the query heads that share KV head `h`
(grouped-query heads are folded into the tile's rows, so each key is loaded once per group), walks the
sequence's keys through its block table `BLOCK_N` positions at a time with an online softmax in float32 (each
tile's block ids loaded in the iteration before, so that its keys' copies can be issued tiles ahead), and
stops at the tile's last causal position. How the attention kernel is launched (keys per tile, warps, stages)
is a `LaunchConfig`, one for decode-only steps and one for the rest.

Under `TRITON_INTERPRET=1` (tests on the CPU) the kernels run in Triton's interpreter, whose bfloat16 `tl.dot`
is wrong, so there (only) the dot products are computed in float32."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import triton_linear
from kernels.attention import AttentionBackend, AttentionMetadata, CommonAttentionMetadata
from kernels.triton_kv_write import fusable_head_dim, norm_qkv_rope_store, rope_store_kv, store_kv
from kernels.triton_linear import dot_mode, interpreting, launch_fitting, pdl_launch, pdl_start


@triton.jit
def _find_seq(query_start_loc, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles contain `tile`: sequence `s` owns tiles from
    `query_start_loc[s] // BLOCK_Q + s` on (a bound that leaves each sequence room for its tiles)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache, v_cache, out_ptr, block_tables, seq_lens, query_start_loc, num_seqs, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, block_size, part_acc, part_ml, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, num_splits,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ONE_QUERY: tl.constexpr, SPLIT: tl.constexpr = False, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """Tile `pid(0)` (with ONE_QUERY: sequence `pid(0)`), KV head `pid(1)`. With SPLIT (ONE_QUERY only)
    program `pid(2)` takes its share of the sequence's keys (one of `num_splits`) and writes its unnormalised
    output, running max and sum to `part_acc` / `part_ml` for `_combine_splits_kernel`. With PREFETCH each tile
    loads the next tile's block ids (`LaunchConfig.prefetch`)."""
    pdl_start(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if ONE_QUERY:  # a decode step: one query token per sequence, one tile per sequence, no search
        seq = tile
        q_begin = tile
        q_len = 1
        q_start = 0
    else:
        seq = _find_seq(query_start_loc, num_seqs, tile, BLOCK_Q)
        q_begin = tl.load(query_start_loc + seq)
        q_len = tl.load(query_start_loc + seq + 1) - q_begin
        q_start = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, within the sequence
        if q_start >= q_len:
            return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # tokens cached before this step

    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    q_idx = q_start + rows // GROUP_P
    head_in_group = rows % GROUP_P
    row_ok = (q_idx < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_begin + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context + q_idx  # absolute position of each row's query

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
    last = tl.minimum(seq_len, context + q_start + BLOCK_Q)  # keys past the tile's last query are masked
    first = 0
    if SPLIT:  # this program's share of the keys, whole tiles
        share = tl.cdiv(tl.cdiv(last, num_splits), BLOCK_N) * BLOCK_N
        first = tl.program_id(2) * share
        last = tl.minimum(last, first + share)
    table = block_tables + seq * stride_bt
    if PREFETCH:  # the first tile's block ids here; each tile loads the next one's, used an iteration later
        pos0 = first + tl.arange(0, BLOCK_N)
        next_block = tl.load(table + pos0 // block_size, mask=pos0 < last, other=0).to(tl.int64)
    for start in range(first, last, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < last
        if PREFETCH:
            block = next_block
            ahead = pos + BLOCK_N
            next_block = tl.load(table + ahead // block_size, mask=ahead < last, other=0).to(tl.int64)
        else:
            block = tl.load(table + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % block_size
        kv_ok = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                    + dims[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_cache + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=kv_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        m_i = m_new
    if SPLIT:
        split = tl.program_id(2)
        p_offs = (q_begin + q_idx)[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + dims[None, :]
        tl.store(part_acc + p_offs, acc, mask=row_ok[:, None] & dim_ok[None, :])
        ml = part_ml + (q_begin + q_idx) * stride_mt + head * stride_mh + split * 2
        tl.store(ml, m_i, mask=row_ok)
        tl.store(ml + 1, l_i, mask=row_ok)
    else:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = (q_begin + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _combine_splits_kernel(part_acc, part_ml, out_ptr, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
                           stride_ot, stride_oh, num_splits, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                           SPLITS_P: tl.constexpr, PDL: tl.constexpr = False):
    """Token `pid(0)`, query head `pid(1)`: its splits' outputs, each rescaled from its own running max to the
    largest, summed and divided by the rescaled sums (a split that saw no key has max -inf and weighs 0)."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P)
    sp_ok = sp < num_splits
    ml = part_ml + t * stride_mt + h * stride_mh + sp * 2
    m = tl.load(ml, mask=sp_ok, other=float("-inf"))
    l = tl.load(ml + 1, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(l * w, 0)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    acc = tl.load(part_acc + t * stride_pt + h * stride_ph + sp[:, None] * stride_ps + dims[None, :],
                  mask=sp_ok[:, None] & dim_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, o.to(out_ptr.dtype.element_ty), mask=dim_ok)


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """How the attention kernel is launched: keys per tile (`BLOCK_N`), warps per program and software-pipeline
    stages of the key loop (Triton's `num_warps`, `num_stages`), whether each tile loads the next tile's block
    ids (`prefetch`), and for decode steps the programs per sequence and KV head (`num_splits`).

    Compiled for sm_90 (triton 3.6 and 3.7), the loop's loads pipeline by `prefetch`. Without it they are a
    chain inside each iteration (the block ids, then the keys and values they point to), the pipeliner spends
    stages on each link, and the keys and values get one shared-memory buffer at 2-4 stages (each tile's
    copies waited for in full at its start: a round trip per tile), two at 5-6, three at 7. With it the keys'
    addresses come from the iteration before, the block ids are a plain load used an iteration later, and the
    keys and values get `num_stages - 1` buffers: two tiles in flight at 3 stages (19 KB of shared memory at 32
    keys, 4 warps)."""

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    # decode steps only: each sequence's keys split between this many programs, whose outputs a second kernel
    # combines (more programs in flight per SM where a batch has few sequences for the GPU's SMs); 0: as many
    # as bring the step's programs to about `SPLIT_TARGET_WAVES` per SM (`decode_splits`)
    num_splits: int = 1
    # each tile loads the next tile's block ids (above); off: the chain the last lease measured
    prefetch: bool = True
    # programmatic dependent launch (`triton_linear.pdl_launch`): the kernel's programs start while the one
    # before ends
    pdl: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps"):
            value = getattr(self, name)
            if value < 16 and name == "block_n" or value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two (block_n at least 16), got {value}")
        if self.num_stages < 1 or self.num_splits < 0:
            raise ValueError(f"num_stages must be positive and num_splits not negative, got {self.num_stages}, "
                             f"{self.num_splits}")


# Read at every launch (the GPU check's `attention_sweep` times others and may set the fastest for its run):
# steps whose every sequence has one query token (decode steps, the captured graphs), and the others. Float32
# (parity checks and tests; tiles twice as large, from full-precision dots) keeps the class's defaults. Decode
# steps launch with programmatic dependent launch and split few sequences' keys between programs: on an H100
# (docs/benchmarks.md, 2026-12-05) a batch-256 step's launch took 20.9 us with it against 22.1 without, and one
# sequence's 5.1 us with 16 splits against 9.6 unsplit; at batch 256 the automatic splits leave it as it is.
DECODE_CONFIG = LaunchConfig(num_splits=0, pdl=True)
CHUNK_CONFIG = LaunchConfig()


def launch_config(dtype: torch.dtype, one_query: bool) -> LaunchConfig:
    """The config a step's attention launches with (see `DECODE_CONFIG`)."""
    if dtype == torch.float32:
        return LaunchConfig()
    return DECODE_CONFIG if one_query else CHUNK_CONFIG


# `num_splits=0`: programs per SM a decode step aims for, and the most splits of one sequence
SPLIT_TARGET_WAVES, MAX_SPLITS = 2, 16
META_SM_COUNT = 132
_SM_COUNT: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """The GPU's multiprocessors (2 for a CPU under the interpreter, so that tests split few-sequence steps as a
    small GPU would in few programs: with 8, each interpreted program dearer than the work it splits, the GPU
    check's dry run took 86 s against 56; 132, an H100's or H200's, on the meta device, where
    `workers.kernel_variants` records the launches a GPU makes)."""
    if device.type == "meta":
        return META_SM_COUNT
    if device.type != "cuda":
        return 2
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def decode_splits(config: LaunchConfig, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many programs share each sequence's keys in a decode step: `config.num_splits`, or for 0 enough to
    give the GPU's SMs `SPLIT_TARGET_WAVES` programs each (at most `MAX_SPLITS`; 1 once the batch alone does:
    at batch 256 of 3 KV heads there are 768 programs for an H200's 132 SMs)."""
    if config.num_splits:
        return config.num_splits
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(MAX_SPLITS, SPLIT_TARGET_WAVES * sm_count(device) // programs))


def attention_grid(num_tokens: int, num_seqs: int, num_kv_heads: int, block_q: int) -> tuple[int, int]:
    """Programs for a batch of `num_tokens` query tokens in `num_seqs` sequences: enough tiles for any
    split of the tokens between the sequences (each sequence may leave one tile partly empty); one per
    sequence when each has one token (as many tokens as sequences: the kernel's `ONE_QUERY`)."""
    if num_tokens == num_seqs:
        return (num_seqs, num_kv_heads)
    return (num_tokens // block_q + num_seqs, num_kv_heads)


def tile_shape(group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_Q, GROUP_P, HEAD_DIM_P): at least 16 rows per tile (`tl.dot`'s minimum)."""
    group_p = triton.next_power_of_2(group)
    return max(1, 16 // group_p), group_p, max(16, triton.next_power_of_2(head_dim))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, config: LaunchConfig | None = None) -> torch.Tensor:
    """Causal attention of `query` ([tokens, heads, head_dim], sequences contiguous and in order) over the
    paged caches ([blocks, block_size, kv_heads, head_dim]); `seq_lens` count cached plus new tokens,
    `query_start_loc` ([seqs + 1]) delimits each sequence's query tokens. Writes and returns `out`.
    `config`: default `launch_config(dtype, one query per sequence)`."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if k_cache.stride(-1) != 1 or query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("paged_attention needs the head dimension contiguous in query, caches and out")
    num_seqs = seq_lens.shape[0]
    if config is None:
        config = launch_config(query.dtype, num_tokens == num_seqs)
    group = num_heads // num_kv_heads
    block_q, group_p, head_dim_p = tile_shape(group, head_dim)
    grid = attention_grid(num_tokens, num_seqs, num_kv_heads, block_q)
    one_query = num_tokens == num_seqs
    splits = decode_splits(config, num_seqs, num_kv_heads, query.device) if one_query and num_tokens else 1
    upcast, precision = dot_mode(query.dtype)
    pdl = pdl_launch(config.pdl, query.device)
    if splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, splits, head_dim_p, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=query.device)
        grid = (*grid, splits)
    else:
        part_acc = part_ml = out
    launch_fitting(
        _paged_attention_kernel, grid,
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, num_seqs, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_size, part_acc, part_ml, *_split_strides(part_acc, part_ml, splits), splits,
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_Q=block_q,
        BLOCK_N=config.block_n, UPCAST=upcast, DOT_PRECISION=precision,
        ONE_QUERY=one_query, SPLIT=splits > 1, PREFETCH=config.prefetch, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl,
    )
    if splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, *_split_strides(part_acc, part_ml, splits), out.stride(0), out.stride(1), splits,
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS_P=max(4, triton.next_power_of_2(splits)),
            num_warps=1 if head_dim_p <= 64 else 2, **pdl)
    return out


def _split_strides(part_acc: torch.Tensor, part_ml: torch.Tensor, splits: int) -> tuple[int, ...]:
    """(token, head, split) strides of the partial outputs and (token, head) of their max and sum; zeros
    without splits (the kernel then writes `out` alone)."""
    if splits == 1:
        return (0,) * 5
    return (part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_ml.stride(0), part_ml.stride(1))


@dataclass(slots=True)
class TritonAttentionMetadata(AttentionMetadata):
    """The step on the cache's device (int64; CUDA graphs capture views of one int64 buffer)."""

    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [num_reqs, max_blocks]
    seq_lens: torch.Tensor  # [num_reqs]: cached plus new tokens
    query_start_loc: torch.Tensor  # [num_reqs + 1]


class TritonPagedAttention(AttentionBackend[TritonAttentionMetadata]):
    """The GPU backend (and, under `TRITON_INTERPRET=1`, a CPU one for tests)."""

    name = "triton"
    graph_safe = True
    triton_layer_ops = True

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "meta") and not interpreting():
            raise ValueError(f"the {self.name} attention backend runs on CUDA devices (and traces on meta), or on "
                             f"{self.device} only under TRITON_INTERPRET=1")

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        def put(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            if self.device.type != "cuda" or t.device.type != "cpu":
                return t.to(device=self.device, dtype=dtype, non_blocking=True)
            # through pinned memory: a copy from pageable memory may wait for the kernels queued before it
            # (a step queued behind the one in flight, `Engine.async_scheduling`)
            return t.to(dtype).pin_memory().to(self.device, non_blocking=True)

        return TritonAttentionMetadata(put(common.slot_mapping, torch.long), put(common.block_tables, torch.long),
                                       put(common.context_lens, torch.long), put(common.query_start_loc, torch.long))

    def graph_metadata(self, slot_mapping, block_tables, seq_lens, query_start_loc) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(slot_mapping, block_tables, seq_lens, query_start_loc)

    def write_kv(self, k_cache, v_cache, key, value, meta: TritonAttentionMetadata) -> None:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def rope_and_write_kv(self, qk, value, rope, ops, k_cache, v_cache, meta: TritonAttentionMetadata) -> None:
        """Both in one kernel (`rope_store_kv`): a launch fewer per layer, 30 a decode step of SmolLM2."""
        rope_store_kv(qk, value, *rope, k_cache, v_cache, meta.slot_mapping)

    def project_qkv(self, x, residual, norm_weight, eps, weight, bias, num_heads, num_kv_heads, rope, ops, k_cache,
                    v_cache, meta: TritonAttentionMetadata):
        """With the Triton layer ops, on steps they fuse the norm and matmul for (`triton_linear.fused_rows_ok`),
        and a power-of-two head_dim of at least 32: one kernel (`norm_qkv_rope_store`), two launches fewer per
        layer. Else the norm-and-matmul, then `rope_and_write_kv`."""
        config = triton_linear.NORM_LINEAR_CONFIG
        head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)
        if (ops.name == "triton" and triton_linear.fused_rows_ok(x, residual, weight, config)
                and fusable_head_dim(head_dim) and meta.slot_mapping.shape[0] == x.shape[0]):
            return norm_qkv_rope_store(x, residual, norm_weight, eps, weight, bias, num_heads, num_kv_heads, *rope,
                                       k_cache, v_cache, meta.slot_mapping, config)
        return super().project_qkv(x, residual, norm_weight, eps, weight, bias, num_heads, num_kv_heads, rope, ops,
                                   k_cache, v_cache, meta)

    def forward(self, query, k_cache, v_cache, meta: TritonAttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(query, k_cache, v_cache, torch.empty_like(query), meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, scale)
