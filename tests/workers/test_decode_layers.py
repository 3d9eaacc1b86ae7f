"""The compiled decoder stack of a decode step (`kernels/csrc_decode_layers.cpp`, through
`CppLayerOps.decode_layers`) against the layer-by-layer loop it replaces: the same kernels in the same order,
so the same tokens and the same logprobs, bit for bit. Steps it does not take (prefill chunks; without
prepacked weights, more rows than the GEMV takes) still run the loop."""

from __future__ import annotations

import pytest
import torch

from compiled_kernels import COMPILED, needs_compiled_kernels
from conftest import write_tiny_model
from engine_runs import greedy_outputs
from kernels import layer_ops
from kernels.cpu_extension import load_extension
from workers.engine import Engine


def _bf16_kernels() -> bool:
    from kernels.cpu_extension import load_extension

    return COMPILED and load_extension().has_avx512_bf16()


def _run(model: str, prompts: list[list[int]]) -> dict[str, tuple[list[int], list]]:
    # not prepacked: the stack then takes at most GEMV_MAX_ROWS rows (tests/workers/test_model_setup_prepack.py
    # runs it over the VNNI copies)
    engine = Engine(model=model, dtype="bfloat16", num_kv_blocks=256, num_threads=2, attention_backend="cpp",
                    prepack_weights=False)
    return greedy_outputs(engine, prompts, 15)


@needs_compiled_kernels
@pytest.mark.skipif(not _bf16_kernels(), reason="the compiled decoder stack needs AVX512-BF16")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a qkv bias
def test_compiled_decode_steps_match_the_layer_loop(kind, tmp_path, default_model_dir, monkeypatch):
    model = write_tiny_model(tmp_path / kind, default_model_dir, model_type=kind, tie_word_embeddings=kind == "llama")
    # the AVX512-BF16 limits on every host (on a CPU with AMX the defaults are lower; see test_layer_ops.py)
    monkeypatch.setattr(layer_ops, "default_row_limits", lambda: (layer_ops.GEMV_MAX_ROWS, layer_ops.VNNI_MAX_ROWS))
    gen = torch.Generator().manual_seed(1)
    # GEMV_MAX_ROWS + 6 requests: decode steps past the GEMV's rows (the loop), then fewer as they end
    count = layer_ops.GEMV_MAX_ROWS + 6
    prompts = [torch.randint(3, 40000, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (count,), generator=gen)]
    real, taken = layer_ops.CppLayerOps.decode_layers, []

    def counted(self, x, *args):
        out = real(self, x, *args)
        taken.append((x.shape[0], out is not None))
        return out

    monkeypatch.setattr(layer_ops.CppLayerOps, "decode_layers", counted)
    compiled = _run(model, prompts)
    assert any(took for _, took in taken), f"no step took the compiled decoder stack: {taken}"
    assert not all(took for _, took in taken), f"every step took the compiled decoder stack: {taken}"
    assert all(took == (rows <= layer_ops.GEMV_MAX_ROWS) for rows, took in taken)
    monkeypatch.setattr(layer_ops.CppLayerOps, "decode_layers", lambda self, *args: None)
    assert _run(model, prompts) == compiled


@needs_compiled_kernels
@pytest.mark.skipif(not _bf16_kernels(), reason="the compiled decoder stack needs AVX512-BF16")
def test_decode_steps_past_the_gemv_run_the_stack_on_onednns_copies(tmp_path, default_model_dir, monkeypatch):
    """With prepacked weights a decode step of more rows than the GEMV takes runs the stack too, its matrices
    on oneDNN's copies (the op the layer loop calls for them): the same tokens and logprobs as the loop."""
    model = write_tiny_model(tmp_path / "llama", default_model_dir, model_type="llama", tie_word_embeddings=True)
    monkeypatch.setattr(layer_ops, "default_row_limits", lambda: (4, 8))  # as on a CPU with AMX, lower
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 40000, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (20,), generator=gen)]
    real, taken = layer_ops.CppLayerOps.decode_layers, []

    def counted(self, x, *args):
        out = real(self, x, *args)
        taken.append((x.shape[0], out is not None))
        return out

    def run() -> dict:
        engine = Engine(model=model, dtype="bfloat16", num_kv_blocks=256, num_threads=2, attention_backend="cpp",
                        prepack_weights=True)
        assert engine.model.ops.decode_max_rows == 8
        return greedy_outputs(engine, prompts, 15)

    monkeypatch.setattr(layer_ops.CppLayerOps, "decode_layers", counted)
    stacked = run()
    assert any(took and rows > 8 for rows, took in taken), taken  # on oneDNN's copies
    assert any(took and rows <= 8 for rows, took in taken), taken  # on the VNNI copies
    monkeypatch.setattr(layer_ops.CppLayerOps, "decode_layers", lambda self, *args: None)
    assert run() == stacked


@needs_compiled_kernels
@pytest.mark.skipif(not _bf16_kernels(), reason="the compiled decoder stack needs AVX512-BF16")
@pytest.mark.skipif(not (COMPILED and load_extension().has_amx_linear()), reason="no AMX tiles on this CPU or OS")
def test_decode_steps_between_the_gemv_and_onednn_run_the_stack_on_the_amx_kernel(tmp_path, default_model_dir,
                                                                                 monkeypatch):
    """On a CPU with AMX a decode step of more rows than the GEMV takes, up to `amx_max_rows`, runs the stack
    on the AMX kernel over the VNNI copies, and past them on oneDNN's copies: the same tokens and logprobs as
    the layer loop, whose `linear` takes the same kernels at the same rows."""
    model = write_tiny_model(tmp_path / "llama", default_model_dir, model_type="llama", tie_word_embeddings=True)
    monkeypatch.setattr(layer_ops, "default_row_limits", lambda: (4, 8))
    monkeypatch.setattr(layer_ops, "AMX_TILE_MAX_ROWS", 14)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 40000, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (20,), generator=gen)]
    real, taken = layer_ops.CppLayerOps.decode_layers, []

    def counted(self, x, h, stack, *args):
        out = real(self, x, h, stack, *args)
        taken.append((x.shape[0], out is not None, self.decode_amx_rows(stack)))
        return out

    def run() -> dict:
        engine = Engine(model=model, dtype="bfloat16", num_kv_blocks=256, num_threads=2, attention_backend="cpp",
                        prepack_weights=True)
        assert engine.model.ops.amx_max_rows == 14
        return greedy_outputs(engine, prompts, 15)

    monkeypatch.setattr(layer_ops.CppLayerOps, "decode_layers", counted)
    stacked = run()
    assert all(amx == 14 for _, _, amx in taken), taken
    assert any(took and 8 < rows <= 14 for rows, took, _ in taken), taken  # on the AMX kernel
    assert any(took and rows > 14 for rows, took, _ in taken), taken  # on oneDNN's copies
    monkeypatch.setattr(layer_ops.CppLayerOps, "decode_layers", lambda self, *args: None)
    assert run() == stacked


@needs_compiled_kernels
@pytest.mark.skipif(not _bf16_kernels(), reason="the compiled decoder stack needs AVX512-BF16")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a qkv bias
def test_steps_with_prompt_chunks_match_the_layer_loop(kind, tmp_path, default_model_dir, monkeypatch):
    """A step with prefill chunks runs every layer up to the last one's attention in one compiled call
    (`mixed_layers`), and the loop's last layer finishes the rows that sample: the same tokens and logprobs as
    the loop. The steps mix whole prompts of one length (torch's flash attention on CPUs with AMX), prompts
    the token budget cut (the chunk kernel) and decodes; with few rows the matrices run on the GEMV, with
    more on the AMX kernel or oneDNN's copies, as in decode steps."""
    from kernels.cpu_extension import has_amx_bf16

    model = write_tiny_model(tmp_path / kind, default_model_dir, model_type=kind, tie_word_embeddings=kind == "llama")
    monkeypatch.setattr(layer_ops, "default_row_limits", lambda: (4, 8))
    gen = torch.Generator().manual_seed(5)
    lengths = [70] * 6 + torch.randint(1, 40, (10,), generator=gen).tolist() + [150, 3]
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in lengths]
    real, taken = layer_ops.CppLayerOps.mixed_layers, []

    def counted(self, x, h, stack, kv_caches, rope, attn, meta):
        out = real(self, x, h, stack, kv_caches, rope, attn, meta)
        taken.append((x.shape[0], out is not None, meta.chunk_path))
        return out

    def run() -> dict:
        engine = Engine(model=model, dtype="bfloat16", num_kv_blocks=256, num_threads=2, attention_backend="cpp",
                        prepack_weights=True, max_num_batched_tokens=200, num_speculative_tokens=0)
        return greedy_outputs(engine, prompts, 15)

    monkeypatch.setattr(layer_ops.CppLayerOps, "mixed_layers", counted)
    stacked = run()
    assert all(took for _, took, _ in taken) and len(taken) >= 3, taken
    paths = {path for _, _, path in taken}
    assert paths >= ({"split", "kernel"} if has_amx_bf16() else {"kernel"}), taken
    assert any(rows > 8 for rows, _, _ in taken), taken
    monkeypatch.setattr(layer_ops.CppLayerOps, "mixed_layers", lambda self, *args: None)
    assert run() == stacked


def test_torch_ops_have_no_compiled_stack():
    assert layer_ops.TorchLayerOps().decode_layers(None, None, None, None, None, None, None) is None
    assert layer_ops.TorchLayerOps().mixed_layers(None, None, None, None, None, None, None) is None
