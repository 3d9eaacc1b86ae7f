"""The optional FlashAttention backends (`kernels/flash_attention.py`), without the packages: neither
`flash-attn` nor `vllm-flash-attn` installs here (no CUDA; the latter pins torch 2.4), so a stand-in module
implements `flash_attn_varlen_func` as the packages document it (paged K/V through an int32 block table,
causal attention aligned to each sequence's last key, grouped heads) and checks every argument the backend
passes against that contract. What runs for real: the backend's K/V store (Triton, interpreted), its
metadata and per-step tables, the self-check against the torch backend, which refuses a wrong kernel, and
`get_attention_backend`'s choice: `auto` takes a package that imports and passes, else the next."""

from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the stand-in runs on the CPU, under TRITON_INTERPRET=1 (tests/conftest.py sets it)",
                allow_module_level=True)

from kernels import attention  # noqa: E402
from kernels.attention import AttentionSpec, CommonAttentionMetadata, get_attention_backend  # noqa: E402
from kernels.cpu_attention import TorchPagedAttention  # noqa: E402
from kernels.flash_attention import (FlashAttnMetadata, FlashAttnPagedAttention,  # noqa: E402
                                     VllmFlashAttnPagedAttention)
from kernels.triton_attention import TritonAttentionMetadata  # noqa: E402

def stand_in(api: str, block_multiple: int, wrong: bool = False, wrong_decode: bool = False) -> ModuleType:
    """A module whose `flash_attn_varlen_func` has the signature of `api` ("upstream": FlashAttention 2's,
    cumulative context lengths; "vllm": vLLM's newer builds', context lengths as `seqused_k`) and computes what
    the package documents, refusing arguments off its contract; `wrong`: it ignores the causal mask (a broken
    build); `wrong_decode`: its decode function (`flash_attn_with_kvcache`) leaves out each sequence's last key."""
    module = ModuleType(f"stand_in_{api}")
    module.calls = []

    def attend(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, block_table, lens):
        table, cu_q = block_table, cu_seqlens_q
        assert table.dtype == cu_q.dtype == lens.dtype == torch.int32 and table.dim() == 2 and causal
        assert k.dim() == 4 and k.shape == v.shape and k.shape[1] % block_multiple == 0 and q.dim() == 3
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        bs, kvh, d = k.shape[1:]
        group = q.shape[1] // kvh
        out = torch.empty_like(q)
        for i, n in enumerate(lens.tolist()):
            start, end = cu_q[i].item(), cu_q[i + 1].item()
            assert end - start <= max_seqlen_q and n <= max_seqlen_k
            blocks = table[i, :-(-n // bs)].long()
            keys, values = k[blocks].reshape(-1, kvh, d)[:n].float(), v[blocks].reshape(-1, kvh, d)[:n].float()
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * softmax_scale
            visible = torch.arange(n)[None, :] <= (n - (end - start) + torch.arange(end - start))[:, None]
            if not wrong:
                s = s.masked_fill(~visible, float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", s.softmax(-1), values).to(q.dtype)
        return out

    if api == "upstream":
        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
            assert cu_seqlens_k.dtype == torch.int32 and cu_seqlens_k[0] == 0
            module.calls.append((max_seqlen_q, max_seqlen_k))
            return attend(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, block_table,
                          cu_seqlens_k.diff())
    else:
        def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                                   seqused_k=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None,
                                   softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                   block_table=None, out=None):
            assert cu_seqlens_k is None and seqused_k is not None  # with a block table, as vLLM calls it
            module.calls.append((max_seqlen_q, max_seqlen_k))
            return attend(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, block_table,
                          seqused_k)

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
        """Queries [batch, seqlen_q, heads, dim] against each sequence's `cache_seqlens` keys through
        `block_table` (nothing appended: k, v None)."""
        assert q.dim() == 4 and k is None and v is None and cache_seqlens.dtype == torch.int32
        batch, seqlen_q = q.shape[:2]
        assert cache_seqlens.shape == (batch,) and block_table.shape[0] == batch
        module.kvcache_calls.append(batch)
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32)
        if wrong_decode:
            cache_seqlens = (cache_seqlens - 1).clamp(min=1)
        flat = attend(q.reshape(batch * seqlen_q, *q.shape[2:]), k_cache, v_cache, cu_q, seqlen_q,
                      int(cache_seqlens.max()), softmax_scale, causal, block_table, cache_seqlens)
        return flat.view(q.shape)

    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    module.kvcache_calls = []
    return module


def _spec(block_size: int, dtype=torch.bfloat16) -> AttentionSpec:
    return AttentionSpec(block_size=block_size, dtype=dtype, num_heads=4, num_kv_heads=2, head_dim=32)


@pytest.mark.parametrize("cls,api,block_size", [(FlashAttnPagedAttention, "upstream", 256),
                                                (VllmFlashAttnPagedAttention, "vllm", 16),
                                                (VllmFlashAttnPagedAttention, "upstream", 16)])  # its 2.6 release
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_package_passes_its_self_check_where_it_serves(cls, api, block_size, dtype):
    """The self-check's paged case (prompt chunks beside decodes, a chunk past a block) agrees with the torch
    backend through each signature: cumulative context lengths (upstream's, and vLLM's 2.6 release), or
    lengths (`seqused_k`, vLLM's newer builds)."""
    fa = stand_in(api, cls.block_multiple)
    backend = cls("cpu", module=fa)
    backend.check(_spec(block_size, dtype))
    # the mixed step through the varlen function, bounded by its own longest query and context; the decode-only
    # step through upstream's decode function (vLLM's build: varlen again, as vLLM calls it)
    if cls is FlashAttnPagedAttention:
        assert fa.calls == [(7, 305)] and fa.kvcache_calls == [4]
    else:
        assert fa.calls == [(7, 305), (1, 258)] and not fa.kvcache_calls


def test_what_a_package_does_not_take_is_refused_by_name():
    backend = FlashAttnPagedAttention("cpu", module=stand_in("upstream", 256))
    with pytest.raises(ValueError, match="multiple of 256, got 16"):
        backend.check(_spec(16))
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        backend.check(_spec(256, torch.float32))
    with pytest.raises(ValueError, match="head_dim"):
        backend.check(AttentionSpec(256, torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=12))


def test_a_wrong_kernel_fails_the_self_check():
    backend = VllmFlashAttnPagedAttention("cpu", module=stand_in("vllm", 16, wrong=True))
    with pytest.raises(ValueError, match="vllm_flash_attn failed its self-check"):
        backend.check(_spec(16))
    # a wrong decode kernel: only decode-only steps take it, so the self-check's decode-only case finds it
    backend = FlashAttnPagedAttention("cpu", module=stand_in("upstream", 256, wrong_decode=True))
    with pytest.raises(ValueError, match=r"flash_attn failed its self-check.*\(\(1, 41\)"):
        backend.check(_spec(256))


def test_a_steps_tables_are_made_once_and_a_graphs_buffers_give_bounds():
    """The int32 tables are made once per step (`begin_step`, which the model calls first), reused by its
    layers and made again for the next step's metadata; a CUDA graph's buffers (the Triton metadata, no host
    lengths) take one query per sequence and the block table's width as the bounds."""
    fa = stand_in("vllm", 16)
    backend = VllmFlashAttnPagedAttention("cpu", module=fa)
    bs, kvh, d = 16, 2, 32
    k_cache = torch.randn(8, bs, kvh, d, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    common = CommonAttentionMetadata(torch.tensor([1, 1]), torch.tensor([0, 1, 2]), torch.tensor([20, 3]),
                                     torch.tensor([[3, 5], [1, 0]]), torch.tensor([5 * bs + 3, bs + 2]), bs, 4, kvh)
    meta = backend.build_metadata(common)
    assert isinstance(meta, FlashAttnMetadata) and (meta.max_query_len, meta.max_seq_len) == (1, 20)
    query = torch.randn(2, 4, d, dtype=torch.bfloat16)
    backend.begin_step(meta)
    first = backend._step
    backend.forward(query, k_cache, v_cache, meta, 0.2)
    backend.forward(query, k_cache, v_cache, meta, 0.2)
    assert backend._step is first and first[1].dtype == torch.int32 and first[3].tolist() == [0, 20, 23]
    graph_meta = TritonAttentionMetadata(meta.slot_mapping, torch.zeros(2, 4, dtype=torch.long),
                                         meta.seq_lens, meta.query_start_loc)
    graph_meta.block_tables[:, :2] = meta.block_tables
    out = backend.forward(query, k_cache, v_cache, graph_meta, 0.2)
    assert backend._step[0] is graph_meta and fa.calls[-1] == (1, 4 * bs)
    reference = TorchPagedAttention("cpu")
    want = reference.forward(query, k_cache, v_cache, reference.build_metadata(common), 0.2)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_upstreams_decode_steps_take_its_decode_function():
    """A decode-only step, eager or a graph's (the Triton metadata over its buffers), goes through
    `flash_attn_with_kvcache` (one query per sequence, the context lengths and block table); a step with a
    prompt chunk through the varlen function."""
    fa = stand_in("upstream", 256)
    backend = FlashAttnPagedAttention("cpu", module=fa)
    bs, kvh, d = 256, 2, 32
    k_cache = torch.randn(4, bs, kvh, d, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    reference = TorchPagedAttention("cpu")
    decode = CommonAttentionMetadata(torch.tensor([1, 1]), torch.tensor([0, 1, 2]), torch.tensor([300, 3]),
                                     torch.tensor([[3, 1], [2, 0]]), torch.tensor([bs + 43, 2 * bs + 2]), bs, 4, kvh)
    query = torch.randn(2, 4, d, dtype=torch.bfloat16)
    meta = backend.build_metadata(decode)
    graph_meta = TritonAttentionMetadata(meta.slot_mapping, torch.zeros(2, 3, dtype=torch.long), meta.seq_lens,
                                         meta.query_start_loc)
    graph_meta.block_tables[:, :2] = meta.block_tables
    want = reference.forward(query, k_cache, v_cache, reference.build_metadata(decode), 0.2)
    for m in (meta, graph_meta):
        out = backend.forward(query, k_cache, v_cache, m, 0.2)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert fa.kvcache_calls == [2, 2] and not fa.calls
    mixed = CommonAttentionMetadata(torch.tensor([1, 3]), torch.tensor([0, 1, 4]), torch.tensor([300, 3]),
                                    torch.tensor([[3, 1], [2, 0]]), torch.tensor([bs + 43, 2 * bs, 2 * bs + 1,
                                                                                  2 * bs + 2]), bs, 4, kvh)
    backend.forward(torch.randn(4, 4, d, dtype=torch.bfloat16), k_cache, v_cache, backend.build_metadata(mixed), 0.2)
    assert fa.calls == [(3, 300)] and fa.kvcache_calls == [2, 2]


def test_auto_takes_the_first_package_that_passes_else_the_next(monkeypatch):
    """`auto` tries the packages in order: one that is not installed, then one whose check fails, are passed
    over quietly; one that passes is taken. An explicit name that fails says why."""
    spec = _spec(16)
    monkeypatch.setitem(attention._AUTO, "cpu", ("flash_attn", "vllm_flash_attn", "torch"))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", stand_in("vllm", 16, wrong=True))
    assert get_attention_backend("auto", "cpu", spec).name == "torch"
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", stand_in("vllm", 16))
    chosen = get_attention_backend("auto", "cpu", spec)
    assert chosen.name == "vllm_flash_attn" and chosen.graph_safe
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in("upstream", 256))
    assert get_attention_backend("auto", "cpu", spec).name == "vllm_flash_attn"  # upstream: not at block 16
    assert get_attention_backend("auto", "cpu", _spec(256)).name == "flash_attn"
    with pytest.raises(ValueError, match="multiple of 256"):
        get_attention_backend("flash_attn", "cpu", spec)
    assert get_attention_backend("flash_attn", "cpu").name == "flash_attn"  # no spec: nothing to check against


def test_the_model_through_a_package_gives_the_torch_backends_logits(tiny_model_dir):
    """The tiny model's forward (a prompt, then a decode step) with vLLM's build (the stand-in) against the
    torch backend, in float32 (which the packages do not take, but the stand-in computes in: so the two agree
    to float32's rounding, where bfloat16's own rounding would hide a wrong context or mask); the model starts
    each step's tables."""
    from workers.engine import Engine

    engine = Engine(model=tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="4MiB",
                    num_speculative_tokens=0)
    model, runner = engine.runner.model, engine.runner
    fa = VllmFlashAttnPagedAttention("cpu", module=stand_in("vllm", 16))
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    n, bs = ids.shape[0], runner.block_size
    steps = [(ids, torch.arange(n), torch.tensor([n]), torch.tensor([0, n]), torch.tensor([n])),
             (torch.tensor([12]), torch.tensor([n]), torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([n + 1]))]
    began = []
    begin_step = fa.begin_step
    fa.begin_step = lambda meta: (began.append(meta), begin_step(meta))
    logits = {}
    for name, backend in (("torch", runner.attn), ("fa", fa)):
        caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
        got = []
        for tokens, positions, q_lens, starts, ctx in steps:
            common = CommonAttentionMetadata(q_lens, starts, ctx, torch.tensor([[2, 3]]), 2 * bs + positions, bs,
                                             runner.num_heads, runner.num_kv_heads)
            meta = backend.build_metadata(common)
            got.append(model(tokens, positions, caches, backend, meta, torch.tensor([tokens.shape[0] - 1])).float())
        logits[name] = got
    # once per forward, before its layers, even for metadata seen before: a CUDA graph's capture makes its
    # tables inside the graph, not the warm-up's
    model(*steps[1][:2], [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches], fa, meta,
          torch.tensor([0]))
    assert len(began) == 3 and began[1] is began[2] is meta and isinstance(meta, FlashAttnMetadata)
    for a, b in zip(logits["fa"], logits["torch"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
