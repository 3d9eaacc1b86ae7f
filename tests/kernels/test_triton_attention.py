"""The Triton kernels: run in Triton's interpreter on the CPU (this machine and CI have no GPU) against
dense attention and the torch backend (compiled ahead of time for sm_90 in tests/workers/test_kernel_variants.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)", allow_module_level=True)

from kernels import triton_attention  # noqa: E402
from kernels.triton_attention import LaunchConfig, attention_grid, paged_attention, tile_shape  # noqa: E402
from kernels.triton_kv_write import store_kv  # noqa: E402
from test_cpu_attention import dense_reference  # noqa: E402

# the kernels' device: a GPU where there is one, else the CPU under Triton's interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


def _paged_case(batch, block_size, heads, kv_heads, dim, dtype, seed=0, num_blocks=400):
    """Random caches holding each sequence's context in scattered blocks, and the step's queries."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, keys, values = [], [], []
    for _, ctx in batch:
        blocks = [free.pop() for _ in range(-(-ctx // block_size))]
        k = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        pos = torch.arange(ctx)
        k_cache[torch.tensor(blocks)[pos // block_size], pos % block_size] = k
        v_cache[torch.tensor(blocks)[pos // block_size], pos % block_size] = v
        tables.append(blocks)
        keys.append(k)
        values.append(v)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = torch.tensor([q for q, _ in batch])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32)
    seq_lens = torch.tensor([c for _, c in batch], dtype=torch.int32)
    query = torch.randn(int(q_lens.sum()), heads, dim, generator=gen).to(dtype)
    on = [t.to(DEVICE) for t in (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)]
    return *on, keys, values


BATCH = [(1, 5), (7, 40), (1, 33), (20, 20), (1, 100), (3, 50), (1, 1)]
DECODES = [(1, 5), (1, 40), (1, 1), (1, 100), (1, 33)]  # one query each: the kernel's ONE_QUERY path
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 16), (9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("batch", [BATCH, DECODES], ids=["mixed", "decodes"])
def test_paged_attention_matches_dense(dtype, block_size, heads, kv_heads, dim, batch):
    query, kc, vc, tables, seq_lens, qsl, keys, values = _paged_case(batch, block_size, heads, kv_heads, dim, dtype)
    out = paged_attention(query, kc, vc, torch.empty_like(query), tables, seq_lens, qsl, dim ** -0.5)
    expected, start = [], 0
    for k, v, (q_len, ctx) in zip(keys, values, batch):
        expected.append(dense_reference(query[start:start + q_len].cpu(), k, v, q_len, ctx))
        start += q_len
    torch.testing.assert_close(out.float().cpu(), torch.cat(expected), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("config", [LaunchConfig(16, 2, 1), LaunchConfig(64, 8, 2), LaunchConfig(128, 4, 3),
                                    LaunchConfig(pdl=True), LaunchConfig(prefetch=False),
                                    LaunchConfig(16, 2, 1, prefetch=False)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_launch_configs_give_the_same_attention(config, block_size):
    """Other key tile widths (16: half a block of 32; 64 and 128: several blocks), warps and stages, programmatic
    dependent launch (on a GPU from sm_90; ignored here), and each tile's block ids loaded in its own iteration
    rather than the one before (`prefetch`): the same result on mixed and decode-only batches."""
    for batch in (BATCH, [(1, 40), (1, 129), (1, 7)]):
        query, kc, vc, tables, seq_lens, qsl, keys, values = _paged_case(batch, block_size, 9, 3, 64, torch.float32)
        default = paged_attention(query, kc, vc, torch.empty_like(query), tables, seq_lens, qsl, 0.125)
        other = paged_attention(query, kc, vc, torch.empty_like(query), tables, seq_lens, qsl, 0.125, config)
        torch.testing.assert_close(other, default, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [LaunchConfig(16, 4, 2, num_splits=2), LaunchConfig(32, 4, 3, num_splits=3),
                                    LaunchConfig(16, 2, 1, num_splits=8), LaunchConfig(num_splits=2, pdl=True),
                                    LaunchConfig(16, 4, 2, num_splits=3, prefetch=False)])
def test_decode_steps_split_between_programs_match_dense(dtype, config):
    """A decode step's keys split between `num_splits` programs per sequence and KV head, combined by a second
    kernel: dense attention's result, with splits that get no key (a context shorter than the splits' tiles)
    and shares that end mid-block; a mixed batch ignores the splits."""
    for batch in ([(1, 40), (1, 129), (1, 7), (1, 1), (1, 100)], BATCH):
        query, kc, vc, tables, seq_lens, qsl, keys, values = _paged_case(batch, 16, 9, 3, 64, dtype, seed=4)
        out = paged_attention(query, kc, vc, torch.empty_like(query), tables, seq_lens, qsl, 0.125, config)
        expected, start = [], 0
        for k, v, (q_len, ctx) in zip(keys, values, batch):
            expected.append(dense_reference(query[start:start + q_len].cpu(), k, v, q_len, ctx))  # scale 64 ** -0.5
            start += q_len
        torch.testing.assert_close(out.float().cpu(), torch.cat(expected), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    with pytest.raises(ValueError, match="num_splits"):
        LaunchConfig(num_splits=-1)


def test_automatic_splits_fill_the_gpu_and_match_dense():
    """`num_splits=0`: a decode step of few sequences splits each one's keys until the GPU's SMs have about two
    programs each (here the interpreter's stand-in of 8 SMs), up to 16; a full batch does not split."""
    from kernels.triton_attention import decode_splits, sm_count

    auto = LaunchConfig(num_splits=0)
    sms = sm_count(DEVICE)
    assert decode_splits(auto, 1, 3, DEVICE) == min(16, 2 * sms // 3)
    assert decode_splits(auto, 1, 1, DEVICE) == min(16, 2 * sms)
    assert decode_splits(auto, 256, 3, DEVICE) == 1 and decode_splits(LaunchConfig(num_splits=3), 256, 3, DEVICE) == 3
    for batch in ([(1, 200)], [(1, 37), (1, 5)]):
        query, kc, vc, tables, seq_lens, qsl, keys, values = _paged_case(batch, 16, 9, 3, 64, torch.float32, seed=5)
        out = paged_attention(query, kc, vc, torch.empty_like(query), tables, seq_lens, qsl, 0.125, auto)
        expected, start = [], 0
        for k, v, (q_len, ctx) in zip(keys, values, batch):
            expected.append(dense_reference(query[start:start + q_len].cpu(), k, v, q_len, ctx))
            start += q_len
        torch.testing.assert_close(out.float().cpu(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_decode_steps_take_the_decode_config(monkeypatch):
    """A step of one token per sequence launches with `DECODE_CONFIG`, any other with `CHUNK_CONFIG`; float32
    with the default."""
    seen = []
    real = triton_attention._paged_attention_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", Spy())
    monkeypatch.setattr(triton_attention, "DECODE_CONFIG", LaunchConfig(64, 8, 2))
    monkeypatch.setattr(triton_attention, "CHUNK_CONFIG", LaunchConfig(16, 2, 1))
    for dtype in (torch.bfloat16, torch.float32):
        for batch in ([(1, 40), (1, 7)], [(1, 40), (3, 7)]):
            query, kc, vc, tables, seq_lens, qsl, _, _ = _paged_case(batch, 16, 4, 2, 32, dtype)
            paged_attention(query, kc, vc, torch.empty_like(query), tables, seq_lens, qsl, 0.125)
    assert seen == [(64, 8, 2), (16, 2, 1), (32, 4, 3), (32, 4, 3)]  # float32 keeps the default
    with pytest.raises(ValueError, match="block_n"):
        LaunchConfig(block_n=24)


def test_grid_covers_any_split_of_the_tokens():
    """Every sequence's tiles fit in the fixed grid whatever the query lengths (the graph-safe bound)."""
    for group, dim in ((1, 64), (3, 64), (8, 128)):
        block_q = tile_shape(group, dim)[0]
        assert attention_grid(7, 7, 2, block_q) == (7, 2)  # one query each: a tile per sequence (ONE_QUERY)
        for lens in ([2] + [1] * 6, [17, 1, 1], [block_q * 3, 1, block_q + 1], [64]):
            tiles = sum(-(-n // block_q) for n in lens)
            starts = [0]
            for n in lens:
                starts.append(starts[-1] + n)
            last = max(starts[s] // block_q + s + -(-lens[s] // block_q) for s in range(len(lens)))
            assert last <= attention_grid(sum(lens), len(lens), 1, block_q)[0] and tiles <= last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (4, 4, 32)])
def test_rope_store_kv_is_rope_then_store(dtype, heads, kv_heads, dim):
    """The fused kernel gives the bits of the layer ops' rotary followed by the store, over a qkv row layout
    (queries, keys and values side by side), negative slots skipped."""
    from kernels.triton_kv_write import rope_store_kv
    from kernels.triton_layer_ops import rope_

    gen = torch.Generator().manual_seed(1)
    tokens, max_pos = 5, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(DEVICE)
    angles = torch.randn(max_pos, dim // 2, generator=gen)
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    positions = torch.tensor([3, 0, 17, 63, 8], device=DEVICE)
    slots = torch.tensor([9, -1, 30, 0, 17], device=DEVICE)
    results = []
    for fused in (False, True):
        x = qkv.clone()
        qk = x[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
        v = x[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
        k_cache = torch.zeros(4, 8, kv_heads, dim, dtype=dtype, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        if fused:
            rope_store_kv(qk, v, cos, sin, positions, k_cache, v_cache, slots)
        else:
            rope_(qk, cos, sin, positions)
            store_kv(qk[:, heads:], v, k_cache, v_cache, slots)
        results.append((x, k_cache, v_cache))
    for plain, fused in zip(*results):
        assert torch.equal(plain, fused)
    assert results[1][1].view(-1, kv_heads, dim).abs().sum((1, 2)).nonzero().flatten().tolist() == [0, 9, 17, 30]


def test_store_kv_writes_slots_and_skips_negative_ones():
    k_cache = torch.zeros(8, 4, 2, 32, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, 2, 32, device=DEVICE), torch.randn(3, 2, 32, device=DEVICE)
    store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 30], device=DEVICE))
    flat_k, flat_v = k_cache.view(-1, 2, 32), v_cache.view(-1, 2, 32)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_v[30], value[2])
    assert flat_k.abs().sum((1, 2)).nonzero().flatten().tolist() == [5, 30]

