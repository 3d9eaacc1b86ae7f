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
