"""`prepack_weights`: when the engine gives the linear layers a packed copy, and that it changes no token."""

from __future__ import annotations

import pytest
import torch

from compiled_kernels import needs_compiled_kernels
from conftest import write_tiny_model
from engine_runs import greedy_outputs
from kernels import layer_ops
from workers.engine import Engine
from workers.model_setup import should_prepack


def test_auto_packs_when_both_copies_fit_an_eighth_of_memory_and_leave_a_quarter(monkeypatch):
    monkeypatch.setattr(layer_ops, "onednn_bf16", lambda: True)  # the sizing on every CPU (see test_layer_ops.py)
    weights = [torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)]
    size = 2 * (64 * 64 * 2 + 32 * 64 * 2)
    total = 8 * size
    assert should_prepack(None, weights + weights[:1], memory_bytes=total, available_bytes=total)  # counted once
    assert not should_prepack(None, weights, memory_bytes=total - 8, available_bytes=total)
    assert should_prepack(None, weights, memory_bytes=total, available_bytes=size + total // 4)
    assert not should_prepack(None, weights, memory_bytes=total, available_bytes=size + total // 4 - 1)
    assert not should_prepack(None, [torch.zeros(64, 64)], memory_bytes=1 << 40)  # float32: nothing to pack
    assert should_prepack(True, [], memory_bytes=0) and not should_prepack(False, weights, memory_bytes=1 << 40)
    assert should_prepack(None, weights) in (True, False)  # this machine's /proc/meminfo and page count


def _run(model: str, prepack: bool, prompts: list[list[int]]) -> tuple[dict, int]:
    engine = Engine(model=model, dtype="bfloat16", num_kv_blocks=512, num_threads=2, attention_backend="cpp",
                    prepack_weights=prepack)
    return greedy_outputs(engine, prompts, 9), len(getattr(engine.model.ops, "_packed", {}))


@needs_compiled_kernels
@pytest.mark.skipif(not layer_ops.onednn_bf16(), reason="oneDNN has no bfloat16 path on this CPU: nothing is packed")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: a qkv bias and an untied LM head
def test_prepacked_weights_are_read_and_onednns_copy_changes_no_bit(kind, tmp_path, default_model_dir, monkeypatch):
    """With `prepack_weights`, steps past the GEMV's rows read oneDNN's copy and the compiled decode steps
    the VNNI copies. oneDNN's copy alone (no VNNI copies) gives every token and logprob of the plain
    weights, bit for bit. The VNNI GEMV sums in another order than the row-major one, so its outputs are
    checked per kernel (tests/kernels/test_gemv_bf16.py) and against transformers on the real model
    (tests/workers/test_engine_parity.py)."""
    model = write_tiny_model(tmp_path / kind, default_model_dir, model_type=kind, tie_word_embeddings=kind == "llama")
    gen = torch.Generator().manual_seed(2)
    # 150 prompts of up to 70 tokens: prefill steps and decode steps past the VNNI GEMV's rows take oneDNN's
    # copy, smaller ones the VNNI copies (up to VNNI_MAX_ROWS rows, beyond the row-major GEMV's)
    prompts = [torch.randint(3, 40000, (int(n),), generator=gen).tolist() for n in torch.randint(1, 70, (150,), generator=gen)]
    # the AVX512-BF16 limits on every host (on a CPU with AMX the defaults are lower; see test_layer_ops.py)
    monkeypatch.setattr(layer_ops, "default_row_limits", lambda: (layer_ops.GEMV_MAX_ROWS, layer_ops.VNNI_MAX_ROWS))
    real_packed, rows = layer_ops.linear_packed, []
    monkeypatch.setattr(layer_ops, "linear_packed", lambda x, *a: rows.append(x.shape[0]) or real_packed(x, *a))
    real_stack, stacks = layer_ops.CppLayerOps.decode_layers, []

    def stack(self, x, h, stack, *args):
        out = real_stack(self, x, h, stack, *args)
        if out is not None:
            stacks.append((x.shape[0], sum(w.dim() == 4 for w in self._stack_weights(stack))))
        return out

    monkeypatch.setattr(layer_ops.CppLayerOps, "decode_layers", stack)
    _, count = _run(model, True, prompts)
    layers = 2  # write_tiny_model's
    assert count == 4 * layers + 1  # qkv, o_proj, gate_up, down per layer, and the LM head
    assert rows and min(rows) > layer_ops.VNNI_MAX_ROWS
    assert {n for _, n in stacks} == {4 * layers}  # every compiled decode step read the layers' VNNI copies
    assert max(r for r, _ in stacks) > layer_ops.GEMV_MAX_ROWS

    real_prepack = layer_ops.CppLayerOps.prepack
    monkeypatch.setattr(layer_ops.CppLayerOps, "prepack", lambda self, w: real_prepack(self, w, vnni=False))
    onednn_only, _ = _run(model, True, prompts)
    plain, none = _run(model, False, prompts)
    assert none == 0
    assert onednn_only == plain
