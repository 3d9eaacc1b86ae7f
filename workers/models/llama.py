"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Plain modules in the gpt-fast manner: the batch is one flat run of tokens (no padding), q/k/v and
gate/up projections are fused into one matmul each, each residual add is fused with the norm after it,
the linear layers run through the layer ops too (a compiled GEMV at decode's few rows, `kernels/layer_ops.py`),
and only the rows that sample go past the last layer's attention.

Under tensor parallelism (`workers/tensor_parallel.py`) each rank builds the same modules over its slices:
q/k/v and gate/up are split by output rows (column-parallel), o_proj and down by input columns
(row-parallel, one all-reduce each), and the embedding and LM head by vocabulary rows."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.layer_ops import DecodeStack, TorchLayerOps
from workers.tensor_parallel import Partition, TPShard, partition


@dataclass(slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    inv_freq: torch.Tensor
    rope_scaling: float = 1.0

    @classmethod
    def from_hf_config(cls, config) -> ModelArgs:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' (NTK scaling that depends on sequence length) is not supported")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            inv_freq=inv_freq.float(),
            rope_scaling=float(scaling),
        )

    def partition(self, tp: TPShard) -> Partition:
        """This rank's slice of the model (the whole model when `tp.size` is 1)."""
        return partition(tp.rank, tp.size, self.num_heads, self.num_kv_heads, self.intermediate_size, self.vocab_size)


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Rows (dim 0) or columns (dim 1) `start:stop` of a checkpoint tensor, zero-padded to `length`."""

    dim: int
    start: int
    stop: int
    length: int


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, part: Partition, tp: TPShard) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = part.num_heads, part.num_kv_heads, a.head_dim, a.rms_norm_eps
        self.tp = tp
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * a.head_dim
        self.input_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.qkv = nn.Parameter(torch.empty(qkv_out, a.hidden_size))
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_out)) if a.qkv_bias else None
        self.o_proj = nn.Parameter(torch.empty(a.hidden_size, self.num_heads * a.head_dim))
        self.post_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.gate_up = nn.Parameter(torch.empty(2 * part.intermediate_size, a.hidden_size))
        self.down = nn.Parameter(torch.empty(a.hidden_size, part.intermediate_size))

    def forward(self, x: torch.Tensor, m: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionBackend, meta: AttentionMetadata,
                ops: TorchLayerOps, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` is the residual stream and `m` the previous layer's output, not yet added in (None for the first
        layer: `x` is the embeddings). Returns the stream after attention and the MLP's output, which the next
        layer (or the final norm) adds in. With `rows`, only those tokens go on past attention (every token
        still writes its K/V)."""
        t, nh, d = x.shape[0], self.num_heads, self.head_dim
        x, q = attn.project_qkv(x, m, self.input_norm, self.eps, self.qkv, self.qkv_bias, nh, self.num_kv_heads, rope,
                                ops, k_cache, v_cache, meta)
        o = attn.forward(q, k_cache, v_cache, meta, d ** -0.5).view(t, nh * d)
        return self.finish(x, o, ops, rows)

    def finish(self, x: torch.Tensor, o: torch.Tensor, ops: TorchLayerOps,
               rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention output `o`: o_proj with the residual add and norm, then the MLP, on
        `rows` only when given."""
        if rows is not None:
            x, o = x[rows], o[rows]
        x, a = ops.norm_gate_up(x, self.tp.all_reduce(ops.linear(o, self.o_proj)), self.post_norm, self.eps, self.gate_up)
        return x, self.tp.all_reduce(ops.linear(a, self.down))


class LlamaForCausalLM(nn.Module):
    """`args` describe the whole model; `part` (from `tp`) the slice this rank holds."""

    def __init__(self, args: ModelArgs, tp: TPShard = TPShard()) -> None:
        super().__init__()
        self.args, self.tp = args, tp
        self.part = part = args.partition(tp)
        rows = part.vocab_rows
        self.embed_tokens = nn.Parameter(torch.empty(rows, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, part, tp) for _ in range(args.num_layers))
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = None if args.tie_word_embeddings else nn.Parameter(torch.empty(rows, args.hidden_size))
        self.cos_table = self.sin_table = torch.empty(0)
        self.ops: TorchLayerOps = TorchLayerOps()  # the engine installs the compiled ops when they build

    def init_rope(self, max_positions: int, dtype: torch.dtype) -> None:
        """cos/sin for every position, computed in float32 on the CPU as Hugging Face does, stored in `dtype` on
        the model's device."""
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * self.args.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        device = self.embed_tokens.device
        self.cos_table = (emb.cos() * self.args.rope_scaling).to(device=device, dtype=dtype)
        self.sin_table = (emb.sin() * self.args.rope_scaling).to(device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn: AttentionBackend, meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Returns logits (in the model's dtype) for the rows in `logits_indices` only. Each residual add
        is fused with the norm after it; the last layer carries only those rows past its attention."""
        ops, eps, last = self.ops, self.args.rms_norm_eps, len(self.layers) - 1
        attn.begin_step(meta)
        rope = (self.cos_table, self.sin_table, positions)
        x = self._embed(input_ids)
        fused = mixed = None
        if self.tp.size == 1 and ops.runs_stacks:
            h = ops.rms_norm(x, self.layers[0].input_norm, eps)
            if logits_indices.numel() == x.shape[0]:  # every row samples: a decode step
                fused = ops.decode_layers(x, h, self._decode_stack, kv_caches, rope, attn, meta)
            if fused is None:  # prefill chunks: all but the last layer's rows that sample
                mixed = ops.mixed_layers(x, h, self._decode_stack, kv_caches, rope, attn, meta)
        if fused is not None:
            h = fused
        elif mixed is not None:
            x, m = self.layers[last].finish(*mixed, ops, logits_indices)
            x, h = ops.add_rms_norm(x, m, self.norm, eps)
        else:  # each layer adds the last one's output in with its input norm
            m = None
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
                x, m = layer(x, m, rope, k_cache, v_cache, attn, meta, ops, logits_indices if i == last else None)
            x, h = ops.add_rms_norm(x, m, self.norm, eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.tp.gather_last_dim(ops.linear(h, head), self.args.vocab_size)

    def linear_weights(self) -> list[torch.Tensor]:
        """Every weight that `forward` passes to `ops.linear`: each layer's qkv, o_proj, gate_up and down, and
        the LM head (the embedding when tied)."""
        weights = [w for layer in self.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        return weights + [self.embed_tokens if self.lm_head is None else self.lm_head]

    @functools.cached_property
    def _decode_stack(self) -> DecodeStack:
        """The layers' weights for `ops.decode_layers`, gathered on first use. It holds the Parameters
        themselves, which loading (`load_hf_weights` copies into them) and moving (`Module.to` swaps their
        data) keep; only the bias placeholder is a tensor of its own, empty, which never goes stale."""
        empty = self.norm.new_empty(0)
        weights: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            after = self.norm if i == len(self.layers) - 1 else self.layers[i + 1].input_norm
            weights += [layer.qkv, empty if layer.qkv_bias is None else layer.qkv_bias, layer.o_proj, layer.post_norm,
                        layer.gate_up, layer.down, after]
        first = self.layers[0]
        return DecodeStack(weights, first.num_heads, first.num_kv_heads, first.head_dim, first.eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings; a rank looks up the ids in its vocabulary range, zeros elsewhere, then all ranks sum."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        start, stop = self.part.vocab
        local = input_ids - start
        inside = (input_ids >= start) & (input_ids < stop)
        x = F.embedding(local.clamp(0, self.part.vocab_rows - 1), self.embed_tokens) * inside[:, None].to(self.embed_tokens.dtype)
        return self.tp.all_reduce(x)

    def shard_spec(self, name: str) -> ShardSpec | None:
        """The slice of the Hugging Face tensor `name` this rank loads; None for the whole tensor."""
        if self.tp.size == 1:
            return None
        p, d = self.part, self.args.head_dim
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return ShardSpec(0, *p.vocab, p.vocab_rows)
        kind = name.rsplit(".", 2)[-2] if name.startswith("layers.") else ""
        ranges = {"q_proj": (0, p.heads, d), "k_proj": (0, p.kv_heads, d), "v_proj": (0, p.kv_heads, d),
                  "o_proj": (1, p.heads, d), "gate_proj": (0, p.intermediate, 1), "up_proj": (0, p.intermediate, 1),
                  "down_proj": (1, p.intermediate, 1)}
        if kind not in ranges:
            return None
        dim, (start, stop), unit = ranges[kind]
        if name.endswith(".bias") and dim == 1:
            return None
        return ShardSpec(dim, start * unit, stop * unit, (stop - start) * unit)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (already cut to `shard_spec` under tensor parallelism), fusing
        q/k/v and gate/up. Raises if any are missing."""
        w = {k.removeprefix("model."): v for k, v in weights}
        missing: list[str] = []

        def take(name: str) -> torch.Tensor:
            if name not in w:
                missing.append(name)
                return torch.zeros(1)
            return w.pop(name)

        mismatched: list[str] = []

        def put(param: nn.Parameter | None, value: torch.Tensor) -> None:
            if param is None:
                return
            if value.shape != param.shape:
                mismatched.append(f"{tuple(value.shape)} for {tuple(param.shape)}")
                return
            param.data.copy_(value)

        put(self.embed_tokens, take("embed_tokens.weight"))
        put(self.norm, take("norm.weight"))
        if self.lm_head is not None:
            put(self.lm_head, take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            put(layer.input_norm, take(p + "input_layernorm.weight"))
            put(layer.post_norm, take(p + "post_attention_layernorm.weight"))
            put(layer.qkv, torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if layer.qkv_bias is not None:
                put(layer.qkv_bias, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            put(layer.o_proj, take(p + "self_attn.o_proj.weight"))
            put(layer.gate_up, torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            put(layer.down, take(p + "mlp.down_proj.weight"))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
        if mismatched:
            raise ValueError(f"checkpoint tensor shapes do not match the config: {mismatched[:3]}")
