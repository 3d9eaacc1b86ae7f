"""Tensor parallelism on GPUs: greedy tokens of a TP engine (one Ray actor per GPU, NCCL) against one GPU's,
in float32. It needs two GPUs and Ray; otherwise it is skipped with the reason. Three or more GPUs split the
checked SmolLM2 shape three ways (9 query heads, 3 KV heads); two split a copy of it with 8 and 2."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from loadtest.gpu_check.engines import generate, greedy, random_prompts, release_memory
from loadtest.gpu_check.greedy_parity import compare
from loadtest.gpu_check.model_files import write_weights
from loadtest.gpu_check.plan import Plan


def why_skipped(plan: Plan) -> str | None:
    import torch

    if plan.dry_run:
        return "dry run: the CPU (gloo) path is tested by tests/workers/test_tensor_parallel.py"
    count = torch.cuda.device_count()
    if count < 2:
        return f"needs >= 2 GPUs; this machine has {count}"
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed here; the ranks are Ray actors"
    return None


def _model_for(size: int, model_dir: Path) -> Path:
    """The checked folder if its heads split `size` ways, else a copy with 8 query and 2 KV heads."""
    config = json.loads((model_dir / "config.json").read_text())
    if config["num_attention_heads"] % size == 0 and config["num_key_value_heads"] % size == 0:
        return model_dir
    folder = model_dir.parent / f"{model_dir.name}-tp{size}"
    folder.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copyfile(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps({**config, "num_attention_heads": 8, "num_key_value_heads": 2}))
    return write_weights(folder)


def check_tp(plan: Plan, model_dir: Path, vocab: int) -> dict:
    import torch

    from workers.config import EngineConfig
    from workers.engine import Engine

    size = 3 if torch.cuda.device_count() >= 3 else 2
    model = str(_model_for(size, model_dir))
    prompts = random_prompts(plan.parity_prompts, plan.parity_prompt_len, vocab, seed=3)
    tokens = {}
    for tp in (1, size):
        config = EngineConfig(model=model, dtype="float32", device="cuda", max_model_len=plan.max_model_len,
                              kv_cache_memory=plan.kv_cache_memory, enforce_eager=True, tensor_parallel_size=tp)
        engine = Engine(config)
        try:
            tokens[tp] = generate(engine, prompts, greedy(plan.parity_tokens), prefix=f"tp{tp}-")
        finally:
            engine.shutdown()
        del engine
        release_memory()
    result = compare(tokens[1], tokens[size])
    return {"passed": result["all_match"], "tensor_parallel_size": size, "model": model, "dtype": "float32",
            "prompts": len(prompts), "tokens_per_prompt": plan.parity_tokens, **result}
