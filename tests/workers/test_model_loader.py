"""Hugging Face folders of the Llama family load and compute what transformers computes: GQA and MQA,
qkv bias (Qwen2), untied embeddings, scaled RoPE, several safetensors shards."""

from __future__ import annotations

import pytest
import torch

from conftest import write_tiny_model
from serving import LLM, SamplingParams


def hf_next_token_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)


VARIANTS = {
    "llama-untied": dict(tie_word_embeddings=False),
    "llama-mqa": dict(num_key_value_heads=1),
    "llama3-rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", sliding_window=None, head_dim=32),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(name, tmp_path, default_model_dir, make_prompts):
    path = write_tiny_model(tmp_path / name, default_model_dir, **VARIANTS[name])
    (prompt,) = make_prompts([37], seed=1)
    expected = hf_next_token_logprobs(path, prompt)
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory="8MiB")
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0].outputs[0]
    top = out.logprobs[0]
    assert out.token_ids[0] == int(expected.argmax())
    for token_id, lp in top.items():
        assert lp.logprob == pytest.approx(float(expected[token_id]), abs=1e-4)


def test_sharded_checkpoint(tmp_path, default_model_dir, make_prompts):
    from transformers import AutoModelForCausalLM

    src = write_tiny_model(tmp_path / "one", default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(src)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="2MB")
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{f}", sharded / f)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    (prompt,) = make_prompts([20])
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    a = LLM(src, dtype="float32", max_model_len=128, kv_cache_memory="4MiB").generate([prompt], params)
    b = LLM(str(sharded), dtype="float32", max_model_len=128, kv_cache_memory="4MiB").generate([prompt], params)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_the_cpu_is_bfloat16_only_where_onednn_runs_it(native, monkeypatch):
    """`dtype="auto"` (the default) is bfloat16 on a CPU whose oneDNN has a bfloat16 path (AVX-512, AMX) and
    float32 on others (AVX2 only), where bfloat16 matmuls are several times slower; explicit names stay."""
    from kernels import cpu_extension
    from workers.config import EngineConfig
    from workers.model_loader import dtype_name, resolve_dtype

    monkeypatch.setattr(cpu_extension, "onednn_bf16", lambda: native)
    assert EngineConfig().dtype == "auto"
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto") == resolve_dtype("auto", torch.device("cpu"))
    for name in ("bfloat16", "float16", "float32"):
        assert dtype_name(resolve_dtype(name, "cpu")) == name
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8")
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="fp32")
    assert EngineConfig(dtype=torch.float16).dtype == "float16"  # a torch dtype, as vLLM takes one


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_dtype_on_cuda_is_bfloat16_where_the_gpu_has_it(bf16, monkeypatch):
    from workers.model_loader import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16 and not including_emulation)
    assert resolve_dtype("auto", "cuda") == (torch.bfloat16 if bf16 else torch.float16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the ranks hold the GPUs, not this process
    assert resolve_dtype("auto", "cuda") == torch.bfloat16


@pytest.mark.parametrize("native", [True, False])
def test_an_engine_resolves_auto_once_and_reports_it(native, tiny_model_dir, monkeypatch):
    """The engine reads `auto` as its device's dtype and keeps the concrete name in its config, so that every
    tensor-parallel rank and whoever reads the config (the server's logs, the bench's JSON) sees the same."""
    from kernels import cpu_extension, layer_ops
    from workers.engine import Engine
    from workers.sizing import dtype_device
    from workers.config import EngineConfig

    monkeypatch.setattr(cpu_extension, "onednn_bf16", lambda: native)
    engine = Engine(model=tiny_model_dir, device="cpu", num_kv_blocks=64, attention_backend="torch")
    want = torch.bfloat16 if native else torch.float32
    assert engine.dtype == want and engine.config.dtype == str(want).removeprefix("torch.")
    assert engine.model.embed_tokens.dtype == want and engine.runner.kv_cache.dtype == want
    assert dtype_device(EngineConfig(device="cpu", tensor_parallel_size=2)) == torch.device("cpu")
    assert Engine(model=tiny_model_dir, dtype="float32", num_kv_blocks=64).dtype == torch.float32
    if not native:
        # bfloat16 asked for on such a CPU: it builds with the default backends, with no copies to prepack (oneDNN
        # refuses to pack a bfloat16 weight there: the engine's construction raised before) and gives tokens
        monkeypatch.setattr(layer_ops, "onednn_bf16", lambda: False)
        engine = Engine(model=tiny_model_dir, dtype="bfloat16", num_kv_blocks=64, prepack_weights=None)
        assert engine.dtype == torch.bfloat16 and not getattr(engine.model.ops, "_packed", {})
        from workers.sampling_params import SamplingParams as Params

        engine.add_request("r", [1, 2, 3], Params(max_tokens=3, temperature=0))
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert len(done) == 1 and len(done[0].outputs[0].token_ids) == 3
