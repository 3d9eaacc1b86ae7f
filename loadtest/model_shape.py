"""The matmul shapes and sizes of a Llama-family model, read from its config.json, in the layout our engine runs
(fused q/k/v and gate/up projections, the LM head only on the rows that sample): what the ceilings measure and
what the rooflines count."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Matmul:
    """One weight matrix, ``out_features x in_features``, applied ``per_token`` times per token through the model."""

    name: str
    out_features: int
    in_features: int
    per_token: int = 1

    @property
    def params(self) -> int:
        return self.out_features * self.in_features

    @property
    def flops_per_row(self) -> int:
        return 2 * self.params


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Hugging Face config dict (Llama, Mistral, Qwen2 names)."""
        try:
            heads = int(config["num_attention_heads"])
            return cls(hidden_size=int(config["hidden_size"]), intermediate_size=int(config["intermediate_size"]),
                       num_layers=int(config["num_hidden_layers"]), num_heads=heads,
                       num_kv_heads=int(config.get("num_key_value_heads") or heads),
                       head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
                       vocab_size=int(config["vocab_size"]))
        except KeyError as exc:
            raise ValueError(f"model config has no {exc.args[0]!r}; expected a Llama-family config.json") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelShape:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {folder}; pass --model or --tokenizer as the model's folder, "
                             "or --no-ceilings")
        return cls.from_config(json.loads(path.read_text(encoding="utf-8")))

    @property
    def layer_matmuls(self) -> tuple[Matmul, ...]:
        """The four weight matrices of every decoder layer, as the engine fuses them."""
        h, n = self.hidden_size, self.num_layers
        return (Matmul("qkv", (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, h, n),
                Matmul("o_proj", h, self.num_heads * self.head_dim, n),
                Matmul("gate_up", 2 * self.intermediate_size, h, n),
                Matmul("down", h, self.intermediate_size, n))

    @property
    def lm_head(self) -> Matmul:
        return Matmul("lm_head", self.vocab_size, self.hidden_size, 1)

    @property
    def matmuls(self) -> tuple[Matmul, ...]:
        return self.layer_matmuls + (self.lm_head,)

    @property
    def layer_params(self) -> int:
        """Weights every token goes through (the decoder layers' matmuls)."""
        return sum(m.params * m.per_token for m in self.layer_matmuls)

    @property
    def weight_params(self) -> int:
        """Weights one decode step reads: the layers' matmuls and the LM head (norms and one embedding row are
        under 0.1% and left out)."""
        return self.layer_params + self.lm_head.params

    @property
    def kv_elements_per_position(self) -> int:
        """K and V elements one cached position holds across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
