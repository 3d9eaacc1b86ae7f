"""Device plumbing without a GPU: the engine with the Triton backend (in Triton's interpreter) on the CPU,
decode CUDA graphs replayed through a stand-in capture, tensors that forget their device caught on the meta
device, and the GPU cache sizing arithmetic."""

from __future__ import annotations

import pytest
import torch
from llm_runs import greedy_tokens

from serving import LLM, SamplingParams
from workers.cuda_graphs import DecodeGraphs, batch_ladder, eager_capture
from workers.penalties import bad_words_token_ids
from workers.request import Request
from workers.scheduler import SchedulerOutput
from workers.sizing import gpu_kv_budget, resolve_device

pytest.importorskip("triton", reason="triton is not installed")

@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:
    return greedy_tokens(LLM(tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB"))


def test_triton_backend_on_cpu_gives_the_torch_backends_tokens(tiny_model_dir, reference):
    llm = LLM(tiny_model_dir, dtype="float32", attention_backend="triton", device="cpu", kv_cache_memory="16MiB",
              max_num_batched_tokens=32)  # chunks, decodes and mixed steps
    assert llm.engine.runner.attn.name == "triton"
    assert greedy_tokens(llm) == reference


@pytest.mark.parametrize("fused", [True, False])
def test_triton_layer_ops_in_the_model_give_the_torch_ops_tokens(tiny_model_dir, reference, monkeypatch, fused):
    """The model on CUDA takes the Triton layer ops with the Triton attention (`build_model`); here they run
    in Triton's interpreter through every kind of step (chunks, decodes, mixed), with the same tokens: with
    each norm fused into the matmul after it (every layer's two: `triton_kv_write.norm_qkv_rope_store` with
    the rotary and K/V store, `triton_linear.norm_linear` for the MLP) and without."""
    from kernels import triton_attention, triton_linear
    from kernels.triton_layer_ops import TritonLayerOps

    calls: list[bool] = []
    mlp, qkv = triton_linear.norm_linear, triton_attention.norm_qkv_rope_store

    def counted_mlp(*args, **kwargs):
        calls.append(kwargs.get("gated", False))
        return mlp(*args, **kwargs)

    def counted_qkv(*args, **kwargs):
        calls.append(False)
        return qkv(*args, **kwargs)

    monkeypatch.setattr(triton_linear, "norm_linear", counted_mlp)
    monkeypatch.setattr(triton_attention, "norm_qkv_rope_store", counted_qkv)
    # the fused kernels as a GPU check's linear sweep applies them where they win; apart, the default
    monkeypatch.setattr(triton_linear, "NORM_LINEAR_CONFIG", triton_linear.LinearConfig() if fused else None)
    llm = LLM(tiny_model_dir, dtype="float32", attention_backend="triton", device="cpu", kv_cache_memory="16MiB",
              max_num_batched_tokens=32)
    assert llm.engine.model.ops.name == "torch"  # on the CPU the torch ops stay
    llm.engine.model.ops = TritonLayerOps()
    assert greedy_tokens(llm) == reference
    layers = len(llm.engine.model.layers)
    if fused:  # every layer of every step: the qkv projection and the gated MLP input
        assert calls and calls.count(True) == calls.count(False) and len(calls) % (2 * layers) == 0
    else:
        assert calls == []


def test_decode_graph_ladder_and_padding_replay_the_eager_tokens(tiny_model_dir, reference):
    llm = LLM(tiny_model_dir, dtype="float32", attention_backend="triton", device="cpu", kv_cache_memory="16MiB")
    replays: list[int] = []

    def counting_capture(fn, pool):
        replay, out = eager_capture(fn, pool)

        def counted():
            replays.append(out.shape[0])
            replay()

        return counted, out

    llm.engine.runner.enable_decode_graphs(max_batch=8, max_model_len=llm.engine.max_model_len,
                                           capture=counting_capture)
    assert llm.engine.runner.graphs.sizes == [1, 2, 4, 8]
    assert greedy_tokens(llm) == reference
    assert replays and set(replays) <= {4, 8}  # 4 running requests, then fewer as none finish early: padded to 4
    assert 4 in replays


def test_decode_graphs_with_async_scheduling_replay_the_eager_tokens(tiny_model_dir, reference):
    """Steps queued ahead replay the graphs with their input ids copied on the device from the step before's
    sampled ids, and with the host buffers taken in turn."""
    llm = LLM(tiny_model_dir, dtype="float32", attention_backend="triton", device="cpu", kv_cache_memory="16MiB",
              num_speculative_tokens=0, async_scheduling=True)
    runner = llm.engine.runner
    runner.enable_decode_graphs(max_batch=8, max_model_len=llm.engine.max_model_len, capture=eager_capture)
    launch_ahead, ahead = runner.launch_ahead, []

    def counted(*args, **kwargs):
        pending = launch_ahead(*args, **kwargs)
        ahead.append(len(args[0]))
        return pending

    runner.launch_ahead = counted
    assert greedy_tokens(llm) == reference
    assert len(ahead) >= 10 and 4 in ahead


@pytest.mark.parametrize("variant", ["plain", "penalized", "grammar"])
def test_steps_queued_ahead_advance_the_graphs_buffers_on_the_device(tiny_model_dir, variant):
    """A step queued ahead over the same rows as the graph step before it advances that graph's buffers on the
    device (`DecodeGraphs.advance`) instead of building its inputs: with blocks of 4 tokens rows take new
    blocks every few steps, and requests ending apart make the steps after an end build theirs again (fewer
    rows), then advance again. Tokens as the torch backend's, eager; `penalized`, with penalties on some rows,
    which count each row's token in flight from the sampled ids the advanced step reads, a row short of its
    `min_tokens`, whose ban counts that token too (its spec changes as the steps advance), and a bad word of
    two tokens a penalized row says, whose last is banned where that token is the word's first; `grammar`,
    with a row under a grammar, beside which the advanced steps queue their forward passes and sample once
    the step in front is applied (`AheadForward`, `RunAhead.sample`)."""
    from llm_runs import PROMPTS as prompts

    penalized = variant == "penalized"

    pen = [{}] * 4
    if penalized:
        pen = [dict(frequency_penalty=0.7), {},
               dict(frequency_penalty=0.4, presence_penalty=0.1, repetition_penalty=1.2), {}]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, **kw) for m, kw in zip((22, 9, 15, 22), pen)]
    if penalized:  # prompts after which the model repeats one token over and over, unless penalized
        prompts = [[42] * 17, prompts[1], [42] * 13, prompts[3]]

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = LLM(tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB", block_size=4)
    reference = tokens(eager)
    free3 = reference[3]
    if penalized:  # and a row short of its min_tokens, whose stop id is the token the model picks at that index
        free = reference[3]
        k = next(k for k in range(10, 20) if free[k] not in free[:k])
        params[3] = SamplingParams(max_tokens=22, temperature=0, ignore_eos=True, min_tokens=k,
                                   stop_token_ids=[free[k]])
        said, tok = reference[0], eager.engine.tokenizer  # (and a bad word on the first, penalized row)
        j, word = next((j, w) for j in range(4, 20) if said[j + 1] not in said[:j + 1]
                       and said[j:j + 2] in bad_words_token_ids(tok, [w := tok.decode(said[j:j + 2])]))
        params[0] = SamplingParams(max_tokens=22, temperature=0, ignore_eos=True, frequency_penalty=0.7,
                                   bad_words=[word])
        reference = tokens(eager)
        assert len(reference[3]) == k + 1
        assert reference[0][:j + 1] == said[:j + 1] and reference[0][j + 1] != said[j + 1]
    if variant == "grammar":  # lowercase letters and spaces, longer than the row's 22 tokens can say
        pytest.importorskip("xgrammar")
        from serving import StructuredOutputsParams

        params[3] = SamplingParams(max_tokens=22, temperature=0, structured_outputs=StructuredOutputsParams(
            regex="[a-z ]{200}"))
        reference = tokens(eager)
        assert len(reference[3]) == 22 and reference[3] != free3
    llm = LLM(tiny_model_dir, dtype="float32", attention_backend="triton", device="cpu", kv_cache_memory="16MiB",
              num_speculative_tokens=0, async_scheduling=True, block_size=4)
    runner = llm.engine.runner
    runner.enable_decode_graphs(max_batch=8, max_model_len=llm.engine.max_model_len, capture=eager_capture)
    graphs = runner.graphs
    advance, run, calls = graphs.advance, graphs.run, []

    def advanced(n, new_blocks, *args):
        calls.append(("advance", n, len(new_blocks) // 2))
        return advance(n, new_blocks, *args)

    graphs.advance = advanced
    graphs.run = lambda *args: calls.append(("run", args[0].shape[0], 0)) or run(*args)
    assert tokens(llm) == reference
    assert (llm.engine._ahead.forwards_queued >= 10) == (variant == "grammar")
    advances = [c for c in calls if c[0] == "advance"]
    assert len(advances) >= 12 and sum(c[2] for c in advances) >= 8  # new blocks reached the device buffers
    assert {c[1] for c in advances} >= {2, 3, 4}  # advanced again after each end
    assert llm.engine.scheduler.kv_cache.usage == 0.0


def test_advancing_a_graph_step_gives_the_inputs_run_builds():
    """`DecodeGraphs.advance` leaves the buffers as `run` fills them for the step after: positions and context
    lengths one on, the slots in the rows' blocks (new ones copied in), padding rows as they were."""
    seen = []

    def forward(input_ids, positions, meta, logits_indices):
        seen.append({"ids": input_ids.clone(), "positions": positions.clone(),
                     **{k: v.clone() for k, v in meta.items()}})
        return torch.zeros(input_ids.shape[0], 3)

    def meta_for(slot_mapping, block_tables, seq_lens, query_start_loc):
        return {"slot": slot_mapping, "tables": block_tables, "seq_lens": seq_lens, "qsl": query_start_loc}

    from kernels.attention import CommonAttentionMetadata

    def common(positions, tables):
        n = len(positions)
        slots = [t[p // 4] * 4 + p % 4 for p, t in zip(positions, tables)]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return CommonAttentionMetadata(torch.ones(n, dtype=torch.long), torch.arange(n + 1),
                                       torch.tensor([p + 1 for p in positions]), torch.tensor(padded),
                                       torch.tensor(slots), 4, 2, 1)

    built = DecodeGraphs(forward, meta_for, max_batch=4, max_blocks=4, device=torch.device("cpu"),
                         capture=eager_capture)
    advanced = DecodeGraphs(forward, meta_for, max_batch=4, max_blocks=4, device=torch.device("cpu"),
                            capture=eager_capture)
    tables = [[7, 8], [3], [6, 2]]
    positions = [6, 3, 7]
    advanced.run(torch.tensor([1, 2, 3]), torch.tensor(positions), common(positions, tables))
    for step in range(6):
        new = []
        positions = [p + 1 for p in positions]
        for row, (p, t) in enumerate(zip(positions, tables)):
            if p // 4 == len(t):  # the row's next block
                t.append(20 + 3 * step + row)
                new += [row * 4 + len(t) - 1, t[-1]]
        ids = torch.tensor([10 + step] * 3)
        seen.clear()
        built.run(ids, torch.tensor(positions), common(positions, tables))
        advanced.advance(3, new, ids, 4)
        want, got = seen
        for key in ("ids", "positions", "slot", "seq_lens", "qsl"):
            assert got[key].tolist() == want[key].tolist(), (step, key)
        for row, t in enumerate(tables):  # each row's blocks (past them: stale ids or zeros, never read)
            assert got["tables"][row, :len(t)].tolist() == t
        assert got["tables"][3].tolist() == want["tables"][3].tolist() == [0] * 4  # the padding row
    assert positions == [12, 9, 13]


def test_batch_ladder():
    assert batch_ladder(1) == [1]
    assert batch_ladder(8) == [1, 2, 4, 8]
    assert batch_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_ladder(256)[-3:] == [224, 240, 256]


def test_graph_padding_rows_write_nowhere_and_see_one_key():
    seen = {}

    def forward(input_ids, positions, meta, logits_indices):
        seen[input_ids.shape[0]] = {k: v.clone() for k, v in meta.items()}
        return torch.zeros(input_ids.shape[0], 3)

    def meta_for(slot_mapping, block_tables, seq_lens, query_start_loc):
        return {"slot": slot_mapping, "tables": block_tables, "seq_lens": seq_lens, "qsl": query_start_loc}

    graphs = DecodeGraphs(forward, meta_for, max_batch=4, max_blocks=3, device=torch.device("cpu"),
                          capture=eager_capture)
    from kernels.attention import CommonAttentionMetadata

    common = CommonAttentionMetadata(torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2, 3]), torch.tensor([5, 9, 2]),
                                     torch.tensor([[7, 8], [3, 4], [6, 0]]), torch.tensor([33, 68, 97]), 4, 2, 1)
    assert graphs.supports(common) and graphs.padded_size(3) == 4
    logits = graphs.run(torch.tensor([11, 12, 13]), torch.tensor([4, 8, 1]), common)
    assert logits.shape == (3, 3)
    m = seen[4]
    assert m["slot"].tolist() == [33, 68, 97, -1]
    assert m["seq_lens"].tolist() == [5, 9, 2, 1]
    assert m["qsl"].tolist() == [0, 1, 2, 3, 4]
    assert m["tables"].tolist() == [[7, 8, 0], [3, 4, 0], [6, 0, 0], [0, 0, 0]]
    assert graphs.copied == graphs._dev.flat.numel()  # the largest graph: every row of the buffers
    one = CommonAttentionMetadata(torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([6]), torch.tensor([[5, 2]]),
                                  torch.tensor([21]), 4, 2, 1)
    graphs.run(torch.tensor([14]), torch.tensor([5]), one)
    m = seen[1]  # a one-row step copies the inputs and one row of block table, not the other rows
    assert graphs.copied == 5 * 6 + 3  # the inputs (each from an even element: 16-byte aligned), one table row
    for buffers in (graphs._dev, *graphs._hosts):
        views = (buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens,
                 buffers.query_start_loc, buffers.block_tables)
        assert all(v.data_ptr() % 16 == 0 for v in views)  # as the compiled kernel variants assume
    assert m["slot"].tolist() == [21] and m["seq_lens"].tolist() == [6] and m["tables"].tolist() == [[5, 2, 0]]
    wide = CommonAttentionMetadata(torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([20]),
                                   torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([70]), 4, 2, 1)
    assert not graphs.supports(wide)  # a block table wider than the captured buffers runs eagerly


def test_captured_steps_read_only_buffers_the_graphs_keep():
    """A CUDA graph replays reads at the addresses its inputs had at capture and keeps none of them alive: a
    tensor made for one capture and then dropped is freed, its memory handed on, and replays read garbage
    (indices out of bounds on a GPU). So a capture that keeps nothing must still find every input a view of
    a buffer the graphs hold."""
    import gc

    from workers import cuda_graphs

    inputs = {}

    def forward(input_ids, positions, meta, logits_indices):
        inputs[input_ids.shape[0]] = [input_ids, positions, logits_indices, *meta]
        return torch.zeros(input_ids.shape[0], 3)

    def capture_keeping_nothing(fn, pool):
        return (lambda: None), fn()

    graphs = cuda_graphs.DecodeGraphs(forward, lambda *t: list(t), max_batch=20, max_blocks=3,
                                      device=torch.device("cpu"), capture=capture_keeping_nothing)
    gc.collect()
    held = {graphs._dev.flat.untyped_storage().data_ptr(), graphs.rows.untyped_storage().data_ptr()}
    assert set(inputs) == set(graphs.sizes) == {1, 2, 4, 8, 16, 20}
    for size, tensors in inputs.items():
        assert len(tensors) == 7
        for t in tensors:
            assert t.untyped_storage().data_ptr() in held, (size, t)
    assert inputs[20][2].tolist() == list(range(20))  # logits rows: every row of the step


def test_a_tensor_that_forgets_its_device_is_caught(tiny_model_dir):
    """Everything on the meta device: any step input or model tensor built on the CPU would fail to mix."""
    from kernels.attention import get_attention_backend
    from workers.model_loader import load_hf_config, load_model, weight_files
    from workers.model_runner import ModelRunner

    meta = torch.device("meta")
    model = load_model(weight_files(tiny_model_dir), load_hf_config(tiny_model_dir), torch.float32, 256, meta)
    assert model.cos_table.device == meta and model.embed_tokens.device == meta
    runner = ModelRunner(model, get_attention_backend("torch", meta), 16, 16, torch.float32, device=meta)
    reqs = [Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), 2),
            Request("b", [6, 7], SamplingParams(max_tokens=2), 2)]
    reqs[0].block_ids, reqs[1].block_ids = [0], [1]
    reqs[0].num_computed_tokens, reqs[1].num_computed_tokens = 4, 1
    out = SchedulerOutput(reqs, [1, 1])  # decodes: the chunk path's boolean masking has no meta kernel
    ids, positions, logits_indices = runner._to_device([torch.tensor([1, 2, 3, 4, 5, 7]), torch.arange(6),
                                                        torch.tensor([4, 5])])
    assert ids.device == meta
    captured = {}
    import workers.model_runner as mr

    class Sampled:  # what `launch_sample` returns, read at once
        def result(self) -> None:
            return None

    original = mr.launch_sample
    mr.launch_sample = lambda logits, *a: (captured.setdefault("logits", logits), Sampled())[1]
    try:
        runner.execute(out)
    finally:
        mr.launch_sample = original
    assert captured["logits"].device == meta and captured["logits"].shape == (2, model.args.vocab_size)


def test_gpu_kv_budget():
    gib = 2 ** 30
    assert gpu_kv_budget(100 * gib, 99 * gib, 10 * gib, 0.9) == 80 * gib
    assert gpu_kv_budget(100 * gib, 40 * gib, 10 * gib, 0.9) == 40 * gib - 60 * gib // 100  # a neighbour holds 60
    with pytest.raises(ValueError, match="no GPU memory left"):
        gpu_kv_budget(100 * gib, 99 * gib, 95 * gib, 0.9)


def test_device_option():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be"):
        from workers.config import EngineConfig

        EngineConfig(device="tpu")


def test_profile_step_runs_on_cpu(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB")
    from workers.model_runner import ModelRunner

    r = llm.engine.runner
    probe = ModelRunner(r.model, r.attn, 4, 16, torch.float32)
    probe.profile(64, 8)  # a full-size step over a scratch cache, as the GPU sizing runs it
    assert probe.kv_cache.abs().sum() > 0
