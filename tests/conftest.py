"""Shared fixtures: the real default model (dense float folder), a tiny random-weight model with the
same tokenizer, and corpus prompts of chosen lengths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from background_tests import (pytest_collection_modifyitems, pytest_collectreport, pytest_configure,  # noqa: F401
                              pytest_runtest_logreport, pytest_runtestloop, pytest_unconfigure)
from workers.model_loader import resolve_dtype

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in Triton's interpreter on the CPU
CORPUS = Path(__file__).resolve().parents[1] / "loadtest" / "data" / "corpus.txt"
# A server app's KV cache in the tests: room for the default model's 8,192 tokens in the dtype `auto` gives this CPU
# (bfloat16, or float32 on a CPU without oneDNN's bfloat16 path, twice the bytes a token)
APP_KV_MEMORY = "256MiB" if resolve_dtype("auto", "cpu") == torch.bfloat16 else "512MiB"


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from workers.model_loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from workers.model_loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def corpus_ids(tokenizer) -> list[int]:
    return tokenizer(CORPUS.read_text()[:200_000], add_special_tokens=False).input_ids


@pytest.fixture(scope="session")
def make_prompts(corpus_ids):
    def make(lengths: list[int], seed: int = 0) -> list[list[int]]:
        return [corpus_ids[(i * 997 + seed) % 20000:][:n] for i, n in enumerate(lengths)]

    return make


def write_tiny_model(path: Path, tokenizer_dir: str, **overrides) -> str:
    """A random-weight Hugging Face model folder with the default tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kind = overrides.pop("model_type", "llama")
    # head_dim 32: the smallest that the compiled bfloat16 attention takes, so bfloat16 tests run it
    kw = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
              initializer_range=0.2, tie_word_embeddings=True)
    kw.update(overrides)
    config = AutoConfig.for_model(kind, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session")
def repeating_model_dir(tmp_path_factory, default_model_dir) -> str:
    """Small random weights: the model repeats a token for a while, then moves to another, so n-gram lookups
    find drafts, most kept and some refused (`tiny_model_dir`'s larger weights never repeat, so never draft)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-repeating"), default_model_dir, initializer_range=0.05)


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    """The reference: a plain transformers LlamaForCausalLM on the same dense weights, float32."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = 2) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


# ---- a real Ray cluster and Ray Serve on 127.0.0.1 for the server tests (tests/serving) ----------------
# One cluster for the whole session; each test module deploys the app it needs under its own route
# prefix (`deploy_app`), so differently configured apps run side by side.

@pytest.fixture(scope="session")
def ray_session():
    """One private local Ray cluster for every test that needs Ray."""
    os.environ.pop("RAY_ADDRESS", None)
    from serving.ray_cluster import init_ray, stop_ray

    temp_dir = init_ray(num_cpus=4)
    import ray

    yield ray
    stop_ray(temp_dir)


@pytest.fixture(scope="session")
def serve_url(ray_session):
    from ray import serve
    from serving.ray_cluster import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


# The apps a test module deployed (`deploy_app`), deleted when the module ends (`_delete_module_apps`): the
# apps of every module left up at once came to most of the machine's memory late in a run. The session's
# shared apps (`main_app_url`, `tiny_app_url`) stay up.
_module_apps: list[str] = []
SESSION_APPS = frozenset({"main", "tiny"})


@pytest.fixture(scope="session")
def deploy_app(serve_url):
    from serving.ray_cluster import deploy_app as deploy_named

    def deploy(name: str, **options) -> str:
        options.setdefault("kv_cache_memory", APP_KV_MEMORY)
        # The apps of a whole run share one machine: without the prepacked copies (twice the weights'
        # memory per replica, tested offline) a run on 24 GB stays clear of Ray's memory monitor.
        options.setdefault("prepack_weights", False)
        _module_apps.append(name)
        return deploy_named(name, options, serve_url, timeout_s=300)

    return deploy


@pytest.fixture(scope="module", autouse=True)
def _delete_module_apps():
    """Delete the apps this module deployed once its tests are done (a module may delete some itself)."""
    yield
    if not _module_apps:
        return
    from ray import serve

    names = set(_module_apps) - SESSION_APPS
    _module_apps.clear()
    running = serve.status().applications
    for name in names & set(running):
        serve.delete(name)


@pytest.fixture(scope="session")
def main_app_url(deploy_app) -> str:
    """The default-model app shared by server test files (`serving_helpers.MAIN_APP_OPTIONS`)."""
    from serving_helpers import MAIN_APP_OPTIONS

    return deploy_app("main", **MAIN_APP_OPTIONS)


@pytest.fixture(scope="session")
def tiny_app_url(deploy_app, tiny_model_dir) -> str:
    """The tiny random-weight model's app (float32), shared by the tests that drive a server with a load
    generator and look only at what it measures."""
    return deploy_app("tiny", model=tiny_model_dir, dtype="float32")
