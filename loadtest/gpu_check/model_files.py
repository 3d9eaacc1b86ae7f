"""The checked model's folder: a config in SmolLM2-135M-Instruct's shape (or a tiny one for the dry run) with
the default model's tokenizer, written here by `--prepare`, and seeded random weights written where it runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64)
TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def model_config(shape: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
            "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "dtype": "float32", **shape}


def prepare(folder: Path, shape: dict = SMOLLM2_SHAPE) -> Path:
    """Write `config.json` and the default model's tokenizer files into `folder` (no weights)."""
    from workers.model_loader import default_model_path

    source = Path(default_model_path())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_config(shape), indent=2) + "\n")
    copied = [name for name in TOKENIZER_FILES if (source / name).exists()]
    if "tokenizer.json" not in copied:
        raise ValueError(f"no tokenizer.json in the default model folder {source}")
    for name in copied:
        shutil.copyfile(source / name, folder / name)
    return folder


def random_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors of the config's shape: projections N(0, 0.02), norms 1 + N(0, 0.02)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    dim = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * dim, config["num_key_value_heads"] * dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    def norm() -> torch.Tensor:
        return 1 + normal(h)

    w = {"model.embed_tokens.weight": normal(config["vocab_size"], h), "model.norm.weight": norm()}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
              p + "self_attn.q_proj.weight": normal(q_out, h), p + "self_attn.k_proj.weight": normal(kv_out, h),
              p + "self_attn.v_proj.weight": normal(kv_out, h), p + "self_attn.o_proj.weight": normal(h, q_out),
              p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
              p + "mlp.down_proj.weight": normal(h, inter)}
    return w


def write_weights(folder: Path, seed: int = 0) -> Path:
    """Write `model.safetensors` (float32) for the folder's config, unless it is already there."""
    from safetensors.torch import save_file

    if not (folder / "config.json").exists():
        raise ValueError(f"{folder} has no config.json: run `python -m loadtest.gpu_check --prepare {folder}` "
                         "on a machine with the default model first")
    target = folder / "model.safetensors"
    if not target.exists():
        config = json.loads((folder / "config.json").read_text())
        tmp = folder / "model.safetensors.tmp"
        save_file(random_weights(config, seed), str(tmp), metadata={"format": "pt"})
        tmp.rename(target)
    return folder
