"""The paged CPU kernel against dense causal attention on random inputs: GQA, mixed chunk/decode
batches, block sizes 1/16/32, context lengths off block boundaries, float32 and bfloat16. The compiled
backend's cases skip where its kernels do not build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_kernels import COMPILED, needs_compiled_kernels
from kernels import CommonAttentionMetadata, available_backends, get_attention_backend

# (new tokens this step, context length including them) per request: decodes and chunks mixed,
# a whole prompt (query == context), a chunk continuing a prompt, lengths off block boundaries.
BATCH = [(1, 5), (7, 40), (1, 33), (20, 20), (1, 100), (3, 50), (1, 1)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def dense_reference(q, k, v, q_len, ctx):
    group = q.shape[1] // k.shape[1]
    qq = q.float().transpose(0, 1)
    kk = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.arange(ctx)[None, :] <= (torch.arange(q_len) + ctx - q_len)[:, None]
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).transpose(0, 1)


try:
    import triton  # noqa: F401  (run in its interpreter here: tests/conftest.py sets TRITON_INTERPRET=1)

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
BACKENDS = ["torch", pytest.param("cpp", marks=needs_compiled_kernels), pytest.param("triton", marks=needs_triton)]


def common_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], slots: list[int],
                    block_size: int, heads: int, kv_heads: int) -> CommonAttentionMetadata:
    """The step as the model runner would describe it; block tables padded with 0."""
    width = max(map(len, block_tables))
    q = torch.tensor(query_lens)
    return CommonAttentionMetadata(q, torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)]),
                                   torch.tensor(context_lens), torch.tensor([t + [0] * (width - len(t)) for t in block_tables]),
                                   torch.tensor(slots), block_size, heads, kv_heads)


def run_case(block_size, dtype, batch, heads=6, kv_heads=2, dim=16, num_blocks=400, seed=0, backend="torch",
             metas=None):
    """The backend's output for `batch` and dense attention's; the step's metadata goes into `metas` if given."""
    gen = torch.Generator().manual_seed(seed)
    backend = get_attention_backend(backend)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-contiguous blocks
    tables, keys, values, slots = [], [], [], []
    for q_len, ctx in batch:
        blocks = [free.pop() for _ in range(-(-ctx // block_size))]
        k = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        for p in range(ctx - q_len):  # what earlier steps cached
            k_cache[blocks[p // block_size], p % block_size] = k[p]
            v_cache[blocks[p // block_size], p % block_size] = v[p]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
        tables.append(blocks)
        keys.append(k)
        values.append(v)
    meta = backend.build_metadata(common_metadata([q for q, _ in batch], [c for _, c in batch], tables, slots,
                                                  block_size, heads, kv_heads))
    if metas is not None:
        metas.append(meta)
    backend.write_kv(k_cache, v_cache, torch.cat([k[c - q:] for k, (q, c) in zip(keys, batch)]),
                     torch.cat([v[c - q:] for v, (q, c) in zip(values, batch)]), meta)
    query = torch.randn(sum(q for q, _ in batch), heads, dim, generator=gen).to(dtype)
    out = backend.forward(query, k_cache, v_cache, meta, dim ** -0.5)
    expected, start = [], 0
    for k, v, (q_len, ctx) in zip(keys, values, batch):
        expected.append(dense_reference(query[start:start + q_len], k, v, q_len, ctx))
        start += q_len
    return out, torch.cat(expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_matches_dense(block_size, dtype, backend):
    out, expected = run_case(block_size, dtype, BATCH, backend=backend)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [[(1, 17)] * 4, [(9, 9), (16, 31)]], ids=["decode-only", "chunks-only"])
def test_single_group_batches(batch, backend):
    out, expected = run_case(16, torch.float32, batch, backend=backend)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_query_attention(backend):
    out, expected = run_case(16, torch.float32, BATCH, heads=8, kv_heads=1, backend=backend)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_fills_slots():
    backend = get_attention_backend()
    cache_k = torch.zeros(4, 2, 1, 3)
    cache_v = torch.zeros(4, 2, 1, 3)
    meta = backend.build_metadata(common_metadata([2], [2], [[3]], [6, 7], 2, 1, 1))
    key = torch.arange(6.0).view(2, 1, 3)
    backend.write_kv(cache_k, cache_v, key, -key, meta)
    assert torch.equal(cache_k[3], key) and torch.equal(cache_v[3], -key)
    assert cache_k[:3].abs().sum() == 0


def test_registry():
    assert {"torch", "cpp"} <= set(available_backends())
    if COMPILED:
        assert get_attention_backend("auto").name == "cpp"
    else:
        with pytest.warns(UserWarning, match="cpp attention unavailable"):
            assert get_attention_backend("auto").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("nope")


@needs_compiled_kernels
def test_compiled_kernels_refuse_other_devices():
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_attention_backend("cpp", "cuda")
    backend = get_attention_backend("cpp")
    meta = backend.build_metadata(common_metadata([1], [1], [[0]], [0], 4, 2, 1))
    cache = torch.zeros(2, 4, 1, 32, device="meta")
    with pytest.raises(ValueError, match="take CPU tensors, got one on meta"):
        backend.forward(torch.zeros(1, 2, 32, device="meta"), cache, cache, meta, 1.0)


@needs_triton
def test_triton_matches_torch_backend_on_a_mixed_batch():
    """The Triton backend against the torch backend itself (not only dense attention), same inputs."""
    for dtype in (torch.float32, torch.bfloat16):
        out_t, _ = run_case(16, dtype, BATCH, heads=9, kv_heads=3, dim=64, backend="triton")
        out_r, _ = run_case(16, dtype, BATCH, heads=9, kv_heads=3, dim=64, backend="torch")
        torch.testing.assert_close(out_t.float(), out_r.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# Longer contexts and real head sizes for the compiled bfloat16 kernels (AVX512-BF16; head_dim a multiple
# of 32): whole prompts, chunks after a cached context, decodes past 512 positions, 16-position tiles cut
# off at every kind of boundary.
LONG_BATCH = [(1, 5), (7, 40), (1, 33), (20, 20), (1, 100), (128, 128), (100, 300), (1, 517), (33, 33), (1, 16),
              (1, 17), (3, 31)]


@needs_compiled_kernels
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (32, 4, 4), (96, 6, 2), (256, 4, 1)])
def test_bf16_kernels_match_dense(block_size, dim, heads, kv_heads):
    backend = get_attention_backend("cpp")
    if backend._bf16:  # the compiled bfloat16 kernels, not the torch fallback, are what runs here
        assert backend._use_bf16(torch.zeros(1, heads, dim, dtype=torch.bfloat16))
    out, expected = run_case(block_size, torch.bfloat16, LONG_BATCH, heads=heads, kv_heads=kv_heads, dim=dim,
                             num_blocks=2000, backend="cpp")
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert (out.float() - expected).abs().mean() < 1e-3  # bfloat16 rounding of the output, no more


@needs_compiled_kernels
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("batch,path", [
    ([(80, 80), (80, 80), (80, 80)], "flash"),  # whole prompts of one length: torch's flash attention
    ([(1, 40), (96, 96), (1, 7), (96, 96)], "flash"),  # decodes in the same step
    ([(300, 700)], "masked"),  # one long chunk after a cached prefix: the masked SDPA
    ([(300, 300)], "flash"),  # one whole long prompt
    ([(80, 80), (81, 81)], "split"),  # lengths differ: one goes to flash attention, the other to the kernel
    ([(1, 40), (96, 96), (30, 130), (96, 96), (1, 7), (50, 50), (96, 96)], "split"),  # a burst's prefill step
    ([(64, 64), (100, 100), (64, 64), (100, 100), (100, 100)], "split"),  # the most common length to flash
    ([(1, 40), (96, 96), (96, 96), (96, 96), (42, 96)], "split"),  # the flash prompts one run of rows
    ([(40, 40), (40, 40)], "kernel"),  # too short to gain
    ([(80, 100), (80, 100)], "kernel"),  # after cached prefixes, more than one chunk
])
def test_bf16_chunk_paths_match_dense(monkeypatch, amx, batch, path):
    """On CPUs with AMX some bfloat16 chunk steps go to torch's SDPA instead of the chunk kernel; every path
    matches dense attention. Without AMX every step keeps the kernel."""
    monkeypatch.setattr("kernels.cpp_attention.has_amx_bf16", lambda: amx)
    if not get_attention_backend("cpp")._bf16:
        pytest.skip("no AVX512-BF16: the bfloat16 kernels are not built")
    metas = []
    out, expected = run_case(16, torch.bfloat16, batch, heads=9, kv_heads=3, dim=64, num_blocks=300, backend="cpp",
                             metas=metas)
    meta = metas[0]
    assert meta.chunk_path == (path if amx else "kernel")
    if meta.chunk_path in ("flash", "split"):  # prompts that follow each other in the step: a slice of rows
        n = int(meta.flash_chunks.query_lens[0])
        at = [i for i, (q, c) in enumerate(batch) if q == c == n]
        assert isinstance(meta.flash_rows, slice) == (at == list(range(at[0], at[-1] + 1)))
    if meta.chunk_path == "split":  # every chunk in exactly one group, the flash group's all whole prompts
        flash, rest = meta.flash_chunks, meta.kernel_chunks
        assert flash.starts.numel() + rest.starts.numel() == meta.chunks.starts.numel()
        assert bool((flash.query_lens == flash.context_lens).all()) and flash.query_lens.unique().numel() == 1
        assert set(flash.starts.tolist()).isdisjoint(rest.starts.tolist())
        whole = [q for q, c in batch if q == c and q >= 64]
        assert flash.query_lens[0] == max(whole, key=whole.count)  # the most common whole-prompt length
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert (out.float() - expected).abs().mean() < 1e-3


@needs_compiled_kernels
@pytest.mark.parametrize("block_size", [1, 16])
def test_bf16_decode_rows_over_the_same_blocks_give_each_rows_own_bits(block_size):
    """Consecutive decode rows over the same blocks at contexts c, c + 1, ... (a speculating request's last
    token and its drafts) share their K/V loads in the kernel; each row's output is the one it gets alone,
    bit for bit. Rows whose tables differ past a shared prefix, or whose contexts do not follow on, are
    computed on their own, and so is a run longer than the kernel's group."""
    ext = get_attention_backend("cpp")._ext
    if not get_attention_backend("cpp")._bf16:
        pytest.skip("no AVX512-BF16: the bfloat16 kernels are not built")
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, num_blocks = 9, 3, 64, 1200
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).bfloat16()
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).bfloat16()
    width = 300 // block_size + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    a, b = perm[:width], perm[width:2 * width]
    shared = a[:2] + b[2:]  # the same first blocks as `a` (a prefix cache hit), then its own
    # rows whose tables agree over the first two blocks, all the first row reads: the third row reads a third
    # block, in which the first row's table differs, so the group must read the last row's table
    edge = 2 * block_size
    rows = ([(a, 40 + i) for i in range(5)] + [(b, 7)] + [(b, 8 + i) for i in range(20)]  # a run past 16 rows
            + [(shared, 28 + block_size), (a, 29 + block_size), (a, 31 + block_size), (a, 200), (b, 201)]
            + [(shared, edge - 1), (a, edge), (a, edge + 1)])
    tables = torch.tensor([t for t, _ in rows])
    contexts = torch.tensor([c for _, c in rows])
    q = torch.randn(len(rows), heads, dim, generator=g).bfloat16()
    out = ext.paged_decode_attention_bf16(q, k, v, tables, contexts, 0.125)
    for i in range(len(rows)):
        alone = ext.paged_decode_attention_bf16(q[i:i + 1], k, v, tables[i:i + 1], contexts[i:i + 1], 0.125)
        assert torch.equal(out[i:i + 1], alone), f"row {i}"
        kk = k[tables[i]].flatten(0, 1)[:contexts[i]].float().repeat_interleave(heads // kv_heads, 1)
        vv = v[tables[i]].flatten(0, 1)[:contexts[i]].float().repeat_interleave(heads // kv_heads, 1)
        p = torch.softmax(torch.einsum("hd,phd->hp", q[i].float(), kk) * 0.125, -1)
        torch.testing.assert_close(out[i].float(), torch.einsum("hp,phd->hd", p, vv), atol=2e-2, rtol=2e-2)


@needs_compiled_kernels
def test_bf16_kernels_take_head_dims_up_to_256():
    """The decode kernel keeps a head's sums in registers (head_dim / 16 of them): past 256 the generic kernels
    run instead, and still match."""
    backend = get_attention_backend("cpp")
    assert not backend._use_bf16(torch.zeros(1, 2, 288, dtype=torch.bfloat16))
    out, expected = run_case(16, torch.bfloat16, [(1, 20), (5, 5)], heads=2, kv_heads=1, dim=288, backend="cpp")
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_compiled_kernels
def test_compiled_write_kv_matches_torch_and_checks_slots():
    cpp, ref = get_attention_backend("cpp"), get_attention_backend("torch")
    qkv = torch.randn(50, 4 * 16 + 2 * 2 * 16).bfloat16()
    key, value = qkv[:, 64:96].view(50, 2, 16), qkv[:, 96:].view(50, 2, 16)  # strided views, as in the model
    common = common_metadata([50], [50], [[0] * 4], torch.randperm(40 * 16)[:50].tolist(), 16, 4, 2)
    cpp_meta, ref_meta = cpp.build_metadata(common), ref.build_metadata(common)
    caches = [[torch.zeros(40, 16, 2, 16, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)]
    cpp.write_kv(*caches[0], key, value, cpp_meta)
    ref.write_kv(*caches[1], key, value, ref_meta)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    cpp_meta.slot_mapping = torch.tensor([0] * 49 + [40 * 16])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpp.write_kv(*caches[0], key, value, cpp_meta)
