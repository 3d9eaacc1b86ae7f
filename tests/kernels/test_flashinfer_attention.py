"""The optional FlashInfer backend (`kernels/flashinfer_attention.py`), without the package: it does not
install here (no CUDA), so `tests/flashinfer_stand_in.py` implements its wrappers' documented `plan` / `run`
contract, graph mode's fixed buffers included. What runs for real: the backend's CSR pages, its choice of
wrapper and one plan per step, its K/V store (Triton, interpreted), the self-check against the torch backend
(which refuses a wrong kernel), the engine's steps through it (chunks, decodes, mixed; CUDA graphs replayed on
the CPU, with steps queued ahead) against the torch backend's tokens, and `auto`'s order."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the stand-in runs on the CPU, under TRITON_INTERPRET=1 (tests/conftest.py sets it)",
                allow_module_level=True)

from flashinfer_stand_in import stand_in  # noqa: E402
from llm_runs import greedy_tokens  # noqa: E402

from kernels import attention  # noqa: E402
from kernels.attention import AttentionSpec, CommonAttentionMetadata, get_attention_backend  # noqa: E402
from kernels.cpu_attention import TorchPagedAttention  # noqa: E402
from kernels.flashinfer_attention import FlashInferPagedAttention, paged_csr  # noqa: E402
from serving import LLM  # noqa: E402
from workers.cuda_graphs import eager_capture  # noqa: E402

def _spec(block_size: int = 16, dtype=torch.bfloat16) -> AttentionSpec:
    return AttentionSpec(block_size=block_size, dtype=dtype, num_heads=4, num_kv_heads=2, head_dim=32)


def test_pages_as_csr():
    """Each sequence's pages (its context over its block-table row), the keys in its last page, the query
    offsets; decode-only when every sequence has one query."""
    csr = paged_csr(torch.tensor([0, 3, 4]), torch.tensor([35, 16]), torch.tensor([[7, 2, 9, 4], [5, 8, 0, 0]]), 16,
                    torch.device("cpu"))
    assert csr.indptr.tolist() == [0, 3, 4] and csr.indices.tolist() == [7, 2, 9, 5]
    assert csr.last_page_len.tolist() == [3, 16] and csr.qo_indptr.tolist() == [0, 3, 4] and not csr.decode
    assert all(t.dtype == torch.int32 for t in (csr.indptr, csr.indices, csr.last_page_len, csr.qo_indptr))
    one = paged_csr(torch.tensor([0, 1, 2]), torch.tensor([1, 17]), torch.tensor([[3, 0], [1, 6]]), 16,
                    torch.device("cpu"))
    assert one.decode and one.indices.tolist() == [3, 1, 6] and one.last_page_len.tolist() == [1, 1]
    with pytest.raises(ValueError, match="do not hold 3 pages"):
        paged_csr(torch.tensor([0, 1]), torch.tensor([40]), torch.tensor([[1, 2]]), 16, torch.device("cpu"))


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_passes_its_self_check(block_size, dtype):
    """The self-check's paged cases agree with the torch backend: a mixed step (prompt chunks beside decodes, a
    chunk past a block) planned once on the prefill wrapper, a decode-only one on the decode wrapper, in the
    spec's dtype and heads."""
    fi = stand_in()
    FlashInferPagedAttention("cpu", module=fi).check(_spec(block_size, dtype))
    assert fi.plans == [("prefill", 5, False), ("decode", 4, False)]
    planned = fi.wrappers[0].planned
    assert (planned["q_dtype"], planned["heads"], planned["kv_heads"], planned["page_size"]) == (dtype, 4, 2,
                                                                                                block_size)


def test_what_it_does_not_take_is_refused_by_name():
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        FlashInferPagedAttention("cpu", module=stand_in()).check(_spec(16, torch.float32))
    with pytest.raises(ValueError, match="flashinfer 0.2 or later"):
        FlashInferPagedAttention("cpu", module=stand_in(old_api=True))
    with pytest.raises(ValueError, match="flashinfer failed its self-check"):
        FlashInferPagedAttention("cpu", module=stand_in(wrong=True)).check(_spec())
    with pytest.raises(ValueError, match=r"flashinfer failed its self-check.*\(\(1, 41\)"):  # the decode-only case
        FlashInferPagedAttention("cpu", module=stand_in(wrong_decode=True)).check(_spec())


def test_one_plan_per_step_on_the_wrapper_of_its_kind():
    """A decode-only step plans the decode wrapper, a step with a prompt chunk the prefill one, at its first
    layer; its other layers run on that plan; a step planned before another is planned again when it runs."""
    fi = stand_in()
    backend = FlashInferPagedAttention("cpu", module=fi)
    bs, kvh, d = 16, 2, 32
    k_cache = torch.randn(8, bs, kvh, d, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    reference = TorchPagedAttention("cpu")
    steps = [CommonAttentionMetadata(torch.tensor([1, 1]), torch.tensor([0, 1, 2]), torch.tensor([20, 3]),
                                     torch.tensor([[3, 5], [1, 0]]), torch.tensor([5 * bs + 3, bs + 2]), bs, 4, kvh),
             CommonAttentionMetadata(torch.tensor([1, 4]), torch.tensor([0, 1, 5]), torch.tensor([21, 7]),
                                     torch.tensor([[3, 5], [1, 0]]), torch.tensor([5 * bs + 4, bs + 3, bs + 4, bs + 5,
                                                                                   bs + 6]), bs, 4, kvh)]
    metas = [backend.build_metadata(c) for c in steps]
    for common, meta, kind in zip(steps, metas + metas[:1], ("decode", "prefill")):
        query = torch.randn(int(common.query_start_loc[-1]), 4, d, dtype=torch.bfloat16)
        for _ in range(3):  # three layers
            out = backend.forward(query, k_cache, v_cache, meta, d ** -0.5)
        assert fi.plans[-1][0] == kind
        want = reference.forward(query, k_cache, v_cache, reference.build_metadata(common), d ** -0.5)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert [p[0] for p in fi.plans] == ["decode", "prefill"]
    backend.forward(torch.randn(2, 4, d, dtype=torch.bfloat16), k_cache, v_cache, metas[0], d ** -0.5)
    assert len(fi.plans) == 2  # the decode wrapper still holds the first step's plan
    with pytest.raises(ValueError, match="planned for"):
        backend.forward(torch.randn(2, 4, d), k_cache.float(), v_cache.float(), metas[0], d ** -0.5)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:
    return greedy_tokens(LLM(tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB"))


@pytest.fixture
def flashinfer(monkeypatch):
    """The stand-in as the `flashinfer` package, taking float32 (which the package does not: so the tiny
    model's tokens are compared to float32's rounding, where bfloat16's would hide a wrong page or mask)."""
    fi = stand_in()
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setattr(FlashInferPagedAttention, "dtypes", (torch.float32, torch.float16, torch.bfloat16))
    return fi


def test_engine_through_flashinfer_gives_the_torch_backends_tokens(tiny_model_dir, reference, flashinfer):
    llm = LLM(tiny_model_dir, dtype="float32", attention_backend="flashinfer", device="cpu", kv_cache_memory="16MiB",
              max_num_batched_tokens=32)  # chunks, decodes and mixed steps
    backend = llm.engine.runner.attn
    assert backend.name == "flashinfer"
    checked = len(flashinfer.plans)  # the self-check's
    forwards = []
    begin_step = backend.begin_step  # the model calls it once per forward pass
    backend.begin_step = lambda meta: (forwards.append(meta), begin_step(meta))
    assert greedy_tokens(llm) == reference
    assert {kind for kind, _, _ in flashinfer.plans[checked:]} == {"decode", "prefill"}
    assert len(flashinfer.plans) - checked == len(forwards) > 10  # one plan a step, not one a layer


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_graphs_plan_before_each_replay(tiny_model_dir, reference, flashinfer, async_scheduling):
    """Decode steps replay graphs whose wrappers read fixed buffers: each size's wrapper is planned on the
    padded step before its replay (else it attends the last plan's pages), with steps queued ahead too."""
    llm = LLM(tiny_model_dir, dtype="float32", attention_backend="flashinfer", device="cpu", kv_cache_memory="16MiB",
              num_speculative_tokens=0, async_scheduling=async_scheduling)
    runner = llm.engine.runner
    runner.enable_decode_graphs(max_batch=8, max_model_len=llm.engine.max_model_len, capture=eager_capture)
    graph_wrappers = [w for w in flashinfer.wrappers if w.graph]
    assert sorted(w.buffers["last_page_len"].shape[0] for w in graph_wrappers) == [1, 2, 4, 8]
    before = len(flashinfer.plans)
    assert greedy_tokens(llm) == reference
    replays = [p for p in flashinfer.plans[before:] if p[2]]
    assert len(replays) >= 10 and {size for _, size, _ in replays} <= {4, 8} and ("decode", 4, True) in replays


def test_auto_takes_flashinfer_after_flashattention_before_triton(monkeypatch):
    assert attention._AUTO["cuda"] == ("vllm_flash_attn", "flash_attn", "flashinfer", "triton")
    monkeypatch.setitem(attention._AUTO, "cpu", ("flashinfer", "torch"))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    assert get_attention_backend("auto", "cpu", _spec()).name == "torch"
    with pytest.raises(ImportError, match="needs the flashinfer-python package"):
        get_attention_backend("flashinfer", "cpu", _spec())
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in(wrong=True))
    assert get_attention_backend("auto", "cpu", _spec()).name == "torch"
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in())
    chosen = get_attention_backend("auto", "cpu", _spec())
    assert chosen.name == "flashinfer" and chosen.graph_safe
