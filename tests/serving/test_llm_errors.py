"""Bad input raises ValueError naming the problem, and the engine stays usable with nothing leaked."""

from __future__ import annotations

import json

import pytest

from serving import LLM, SamplingParams
from workers.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")


@pytest.mark.parametrize("kwargs, words", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n must"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": -1}, "logprobs"),
])
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_prompt_too_long(llm):
    with pytest.raises(ValueError, match=r"prompt has 300 tokens; max_model_len is 256"):
        llm.generate([[5] * 300], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens is 100"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=100))


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate([[1, 2, 10**9]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="messages must not be empty"):
        llm.chat([], SamplingParams(max_tokens=2))


def test_batch_with_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 10, [5] * 400], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_engine_usable_after_errors(llm):
    for bad in ([[5] * 300], ""):
        with pytest.raises(ValueError):
            llm.generate(bad, SamplingParams(max_tokens=3))
    out = llm.generate(["hello there", [7, 8, 9]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    stats = llm.engine.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0 and stats.num_waiting == 0


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_non_llama_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="model_type 'gpt2'.*not supported"):
        LLM(str(tmp_path))


def test_missing_weights(tmp_path, tiny_model_dir):
    import shutil

    shutil.copy(f"{tiny_model_dir}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kwargs, words", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 0}, "block_size"),
    ({"scheduling_policy": "random"}, "scheduling_policy"),
    ({"kv_cache_memory": "lots"}, "memory size"),
    ({"dtype": "int3"}, None),
])
def test_bad_engine_options(kwargs, words, tiny_model_dir):
    with pytest.raises(ValueError, match=words or "dtype"):
        if "dtype" in kwargs:
            LLM(tiny_model_dir, **kwargs)
        else:
            EngineConfig(**kwargs)


def test_kv_cache_smaller_than_max_model_len(tiny_model_dir):
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(tiny_model_dir, max_model_len=512, num_kv_blocks=4)


def test_chunked_prefill_off_needs_budget(tiny_model_dir):
    with pytest.raises(ValueError, match="chunked prefill off"):
        LLM(tiny_model_dir, max_model_len=1024, enable_chunked_prefill=False, max_num_batched_tokens=256)


def test_an_engine_config_or_engine_options_not_both(tiny_model_dir):
    config = EngineConfig(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    (out,) = LLM(config=config).generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="not both"):
        LLM(tiny_model_dir, config=config)


def test_a_request_that_fails_in_the_engine_raises_and_frees_everything(llm, monkeypatch):
    real = llm.engine.runner._generator

    def generator(request_id: str, seed: int | None):
        if seed == 666:
            raise OverflowError("Overflow when unpacking long long")
        return real(request_id, seed)

    monkeypatch.setattr(llm.engine.runner, "_generator", generator)
    good = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(RuntimeError, match=r"prompt 1 of this batch failed: request 'offline-\d+' .*Overflow"):
        llm.generate([[5, 6, 7], [8, 9, 10]], [good, SamplingParams(max_tokens=4, seed=666)])
    stats = llm.engine.get_stats()
    assert not llm.engine.has_unfinished_requests() and stats.kv_cache_usage == 0.0
    (out,) = llm.generate([[5, 6, 7]], good)
    assert len(out.outputs[0].token_ids) == 4
