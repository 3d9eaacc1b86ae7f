"""Layer ops of the Llama-family decoder (the element-wise ops and the linear layers), in two implementations
with one interface.

`TorchLayerOps` is Hugging Face's arithmetic written in torch; `CppLayerOps` runs the same arithmetic
fused in the compiled CPU kernels (`kernels/csrc_layer_ops.cpp`): one pass over memory per op instead of
one per torch expression, no temporaries. Its `linear` runs bfloat16 layers over a few rows (decode) with
the compiled GEMV (`kernels/csrc_gemv_bf16.cpp`), which streams the weights at memory bandwidth where
oneDNN reads them at a fraction of it. `prepack` gives each layer's weights two more copies: one in the
GEMV's own pair-interleaved layout, which steps of up to 128 rows then read (on a CPU with AMX: the GEMV up
to 8 rows, kvrelay's AMX kernel, `kernels/csrc_amx_linear.cpp`, up to 64), and one in oneDNN's blocked
layout, which larger steps (prefill) read with the same bits as `F.linear` and without its per-call
reordering. `get_layer_ops("auto")` picks the compiled ops when they build."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.cpu_extension import has_amx_bf16, onednn_bf16


# Every linear layer of SmolLM2-135M's 30 layers in turn, 2 threads, median of 7, four runs on one host
# (docs/benchmarks.md): the GEMV takes 0.38-0.46x F.linear's time at 8 rows, 0.55-0.59x at 16, 0.59-0.75x at
# 24, 0.72-0.90x at 32, 0.78-0.91x at 40 and 0.83-1.01x at 64; prefill steps take oneDNN.
GEMV_MAX_ROWS = 32
# Over the VNNI copies that `CppLayerOps.prepack` makes, the same layers, two rounds on one host: the GEMV
# 1.9-2.6x F.linear at 16-32 rows, 1.1-1.4x oneDNN's packed copy at 48-64, 1.0-1.2x at 96-256, and
# 0.85-1.2x at 512-2048 (docs/benchmarks.md). Up to this many rows a step reads the VNNI copy; past it
# oneDNN, which on CPUs with AMX has tiles of its own for large matmuls.
VNNI_MAX_ROWS = 128
# On a CPU with AMX, oneDNN's packed copy runs on the tiles: on a 2-core Xeon (amx_bf16) it overtook the VNNI
# GEMV between 8 and 12 rows (146 vs 181 GFLOP/s at 8, 212 vs 194 at 12, 975 vs 209 at 128), where the GEMV's
# AVX512-BF16 dot products top out at ~200 GFLOP/s; burst cap 256 offline went from 622 to 800 tok/s with both
# limits at 8 (docs/benchmarks.md). The row-major GEMV against F.linear crossed between 12 and 16 rows.
AMX_GEMV_MAX_ROWS = AMX_VNNI_MAX_ROWS = 8
# Past those 8 rows, up to this many, a CPU with AMX runs the VNNI copies on the tiles with kvrelay's own kernel
# (`kernels/csrc_amx_linear.cpp`), which streams each weight once, where oneDNN's packed copy read them at
# 11-17 GB/s. A decode step's four matmuls over 30 layers' weights out of cache, 2-core Xeon: 10.0 against
# 13.5 ms at 16 rows, 11.9 against 15.2 at 32, 15.7 against 17.3 at 64, even at 96-200; the LM head 3.5
# against 3.9 ms at 64 rows. Whole decode steps at 12-24 rows took 16-19% less time, at 64 rows 2-3% less,
# and more rows gained nothing (docs/benchmarks.md).
AMX_TILE_MAX_ROWS = 64
# oneDNN compiles a primitive for each row count it meets: 1-2 ms for each of SmolLM2-135M's five matrices, on
# a step whose matmuls take 10-60 ms, and a decode step's row count is seldom the last one's (an offline burst
# compiled 355 of them). Over prepacked copies, rows are padded with zeros up to a multiple of this, so steps
# share primitives; the padding costs a few rows' arithmetic (docs/benchmarks.md).
ONEDNN_ROW_BUCKET = 32
# float32 steps of up to this many rows run the compiled float32 GEMV (`kernels/csrc_gemv_f32.cpp`; it takes 64 at
# most). SmolLM2-135M's linear layers, 30 layers each its own weights and the LM head, 2 threads, on a 2-core
# AMD Zen 3 (AVX2): it read the weights at 28-29 GB/s at one row against F.linear's 15, 24-25 against 8 at 2 rows,
# 19 against 8 at 8; it took 0.6x F.linear's time at 16 rows, 0.8x at 32, 0.9x at 48 and 1.0x at 64
# (docs/benchmarks.md). Measured on that CPU only: where MKL's float32 path is faster the limit may be lower.
F32_GEMV_MAX_ROWS = 48


def default_row_limits() -> tuple[int, int]:
    """`(gemv_max_rows, vnni_max_rows)` for this CPU: the compiled GEMV's limits where oneDNN's AMX
    tiles take over early, the AVX512-BF16 ones elsewhere."""
    return (AMX_GEMV_MAX_ROWS, AMX_VNNI_MAX_ROWS) if has_amx_bf16() else (GEMV_MAX_ROWS, VNNI_MAX_ROWS)


@dataclass(frozen=True, slots=True)
class DecodeStack:
    """A model's decoder layers as `decode_layers` takes them: per layer its qkv weight, qkv bias (an empty
    tensor for none), o_proj, post-attention norm, gate_up, down, and the next input norm (the final norm
    after the last layer)."""

    weights: list[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


class TorchLayerOps:
    name = "torch"
    # whether `decode_layers` / `mixed_layers` may run a step (else the model runs its layer loop and does not
    # compute the first norm for them)
    runs_stacks = False

    def decode_layers(self, x: torch.Tensor, h: torch.Tensor, stack: DecodeStack,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor], attn: AttentionBackend,
                      meta: AttentionMetadata) -> torch.Tensor | None:
        """Every layer of a decode-only step in one compiled call, where these ops have one: updates the
        residual stream `x` in place and returns the last layer's output norm. None: run the layers one by
        one."""
        return None

    def mixed_layers(self, x: torch.Tensor, h: torch.Tensor, stack: DecodeStack,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor], attn: AttentionBackend,
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A step with prefill chunks through every layer up to the last layer's attention in one compiled
        call, where these ops have one: returns the residual stream and that attention's output, for the
        caller to finish the last layer on the rows that sample. None: run the layers one by one."""
        return None

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ weight.T + bias`, as `F.linear`."""
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """As Hugging Face computes it: normalise in float32, scale in the model's dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`x + residual` and its RMSNorm. The compiled version updates `x` in place; use the result."""
        x = x + residual
        return x, self.rms_norm(x, weight, eps)

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's input: `x + residual` (the previous layer's output added in; `x` alone for the first
        layer) and the projection of its RMSNorm, `linear(rms_norm(sum), weight, bias)`. Use the results."""
        if residual is None:
            total, h = x, self.rms_norm(x, norm_weight, eps)
        else:
            total, h = self.add_rms_norm(x, residual, norm_weight, eps)
        return total, self.linear(h, weight, bias)

    def norm_gate_up(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's MLP input: `x + residual` (attention's output added in) and
        `silu_and_mul(linear(rms_norm(sum), gate_up))`. Use the results."""
        total, h = self.add_rms_norm(x, residual, norm_weight, eps)
        return total, self.silu_and_mul(self.linear(h, gate_up))

    @staticmethod
    def rope_(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate `x` ([tokens, heads, head_dim]) in place: Hugging Face's `x * cos + rotate_half(x) * sin`,
        written per half so it rounds identically. The tables are [positions, head_dim], halves equal."""
        half = x.shape[-1] // 2
        cos = cos_table[positions, :half].unsqueeze(1)
        sin = sin_table[positions, :half].unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty_like(x)
        torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
        torch.add(x2 * cos, x1 * sin, out=out[..., half:])
        x.copy_(out)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum ([rows, vocab] -> [rows] int64), a NaN counting above every number: the
        greedy token. `max(dim=-1)` rather than `argmax`, which is ~5x slower on the CPU in bfloat16."""
        return logits.max(dim=-1).indices


class CppLayerOps(TorchLayerOps):
    name = "cpp"
    runs_stacks = True

    def __init__(self, gemv_max_rows: int | None = None, vnni_max_rows: int | None = None,
                 amx_max_rows: int | None = None, f32_max_rows: int | None = None) -> None:
        """The limits default to `default_row_limits()` for this CPU; `amx_max_rows` (the AMX kernel's, for
        steps past `vnni_max_rows` over the VNNI copies) to `AMX_TILE_MAX_ROWS` where the CPU and OS run AMX
        tiles, and is 0 where they do not; `f32_max_rows` to `F32_GEMV_MAX_ROWS`."""
        from kernels.cpu_extension import load_extension

        gemv_default, vnni_default = default_row_limits()
        gemv_max_rows = gemv_default if gemv_max_rows is None else gemv_max_rows
        vnni_max_rows = vnni_default if vnni_max_rows is None else vnni_max_rows

        self._ext = load_extension()
        self._gemv = self._ext.gemv_bf16 if self._ext.has_avx512_bf16() else None
        self.gemv_max_rows, self.vnni_max_rows = gemv_max_rows, max(gemv_max_rows, vnni_max_rows)
        amx = self._gemv is not None and self._ext.has_amx_linear()
        self.amx_max_rows = (AMX_TILE_MAX_ROWS if amx_max_rows is None else amx_max_rows) if amx else 0
        self.onednn_row_bucket = ONEDNN_ROW_BUCKET  # see `linear_packed`
        # float32 steps of up to this many rows take the float32 GEMV (0: all take `F.linear`)
        self.f32_max_rows = F32_GEMV_MAX_ROWS if f32_max_rows is None else f32_max_rows
        # prepack's copies by id of the weight (kept beside it, so an id is never taken by another tensor)
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._vnni: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # by oneDNN or not: the last stack, its weights as `decode_layers_bf16` takes them, and whether the AMX
        # kernel takes every matrix among them
        self._stacks: dict[bool, tuple[DecodeStack, list[torch.Tensor] | None, bool]] = {}

    def prepack(self, weights: list[torch.Tensor], vnni: bool = True) -> int:
        """Give each bfloat16 CPU weight two more copies, one per kind of step; returns the bytes they take.

        - Up to `vnni_max_rows` rows, the GEMV's own layout (`pack_vnni_bf16`: pairs of columns of 16 rows
          side by side), which it reads with no horizontal sums: 25-65% faster than the row-major GEMV at
          16-32 rows, the same at 1-4, and faster than oneDNN up to 128. Weights whose rows are not a
          multiple of 16 keep the row-major GEMV up to `gemv_max_rows`.
        - Past them, oneDNN's blocked layout. oneDNN reorders a plain weight on every `F.linear` call; with
          the copy it reads the blocked one directly, 5-25% faster for 33-2048 rows, with the same bits
          (checked here on each shape; a mismatch makes no copies at all).

        Both measured at SmolLM2-135M's shapes on a 2-core Zen 4 (docs/benchmarks.md). `vnni=False` makes
        only oneDNN's copy."""
        weights = [w for w in dict.fromkeys(weights) if packable(w)]
        if not weights:
            return 0
        packed = {id(w): (w, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)) for w in weights}
        checked: set[tuple[int, ...]] = set()
        g = torch.Generator().manual_seed(0)
        for w, p in packed.values():
            if tuple(w.shape) in checked:
                continue
            checked.add(tuple(w.shape))
            rows = -(-(self.vnni_max_rows + 3) // self.onednn_row_bucket) * self.onednn_row_bucket  # as padded
            x = torch.randn(rows, w.shape[1], generator=g).to(w.dtype)
            if not torch.equal(linear_packed(x, p, None, self.onednn_row_bucket), F.linear(x, w)):
                warnings.warn(f"oneDNN's packed weights gave other bits than F.linear for {tuple(w.shape)}; "
                              "not prepacking", stacklevel=2)
                return 0
        copies = {}
        if vnni and self._gemv is not None:
            copies = {id(w): (w, self._ext.pack_vnni_bf16(w.detach())) for w in weights
                    if w.shape[0] % 16 == 0 and w.shape[1] % 2 == 0}
        self._packed, self._vnni, self._stacks = packed, copies, {}
        return sum(w.nbytes for w in weights) + sum(w.nbytes for w, _ in copies.values())

    def _stack_weights(self, stack: DecodeStack, onednn: bool = False) -> list[torch.Tensor] | None:
        """`stack.weights` with each matrix that has a VNNI copy replaced by it, or (`onednn`) every matrix
        by its oneDNN copy: None if one has none. Made once per stack."""
        return self._stack_entry(stack, onednn)[1]

    def _stack_entry(self, stack: DecodeStack, onednn: bool) -> tuple[DecodeStack, list[torch.Tensor] | None, bool]:
        copies = self._packed if onednn else self._vnni
        if not copies:
            return stack, None if onednn else stack.weights, False
        cached = self._stacks.get(onednn)
        if cached is None or cached[0] is not stack:
            swapped: list[torch.Tensor] | None = []
            for w in stack.weights:
                entry = copies.get(id(w))
                if entry is not None and entry[0] is w:
                    swapped.append(entry[1])
                elif onednn and w.dim() == 2:
                    swapped = None
                    break
                else:
                    swapped.append(w)
            # the AMX kernel: every matrix in the VNNI layout, with K a multiple of 32 (one tile's columns)
            amx = (swapped is not None and not onednn and not any(w.dim() == 2 for w in swapped)
                   and all(w.shape[1] % 16 == 0 for w in swapped if w.dim() == 4))
            self._stacks[onednn] = cached = (stack, swapped, amx)
        return cached

    @property
    def decode_max_rows(self) -> int:
        """The most rows a decode step runs through `decode_layers` on the compiled GEMV: `vnni_max_rows` once
        `prepack` has made the VNNI copies, else `gemv_max_rows`. Larger decode steps run it on the AMX kernel
        up to `amx_max_rows` (`decode_amx_rows`), then on oneDNN's copies, when `prepack` made them."""
        return self.vnni_max_rows if self._vnni else self.gemv_max_rows

    def decode_amx_rows(self, stack: DecodeStack) -> int:
        """The most rows a decode step of `stack` runs on the AMX kernel (over the VNNI copies, once `prepack`
        made one for every matrix), or 0."""
        if not self._vnni or self.amx_max_rows <= self.vnni_max_rows or not self._stack_entry(stack, False)[2]:
            return 0
        return self.amx_max_rows

    def _stack_step(self, x, stack, attn, meta) -> tuple[list[torch.Tensor], bool, bool] | None:
        """How a compiled stack runs a step of `x`'s bfloat16 rows through the compiled attention: its weights,
        whether on oneDNN's copies, whether on the AMX kernel. Up to `decode_max_rows` rows on the GEMV; past
        them on the AMX kernel up to `decode_amx_rows`, then on oneDNN's copies, if `prepack` made them for
        every matrix. None: the layer loop."""
        from kernels.cpp_attention import CppAttentionMetadata, CppPagedAttention

        if (self._gemv is None or not isinstance(attn, CppPagedAttention)
                or not attn.takes_bf16(x.dtype, stack.head_dim) or not isinstance(meta, CppAttentionMetadata)):
            return None
        rows = x.shape[0]
        amx = self.decode_max_rows < rows <= self.decode_amx_rows(stack)
        onednn = rows > self.decode_max_rows and not amx
        weights = self._stack_weights(stack, onednn)
        return None if weights is None else (weights, onednn, amx)

    def decode_layers(self, x, h, stack, kv_caches, rope, attn, meta):
        """A decode-only step of bfloat16 rows through the compiled attention: the same kernels in the same
        order as the layer loop (so the same numbers), with the Python between them run once per step
        instead of once per op, and without the GIL (`kernels/csrc_decode_layers.cpp`). Up to
        `decode_max_rows` rows on the GEMV; past them on the AMX kernel up to `decode_amx_rows`, then on
        oneDNN's copies, if `prepack` made them for every matrix (else None: the layer loop)."""
        step = self._stack_step(x, stack, attn, meta)
        if step is None or meta.chunks is not None or meta.decodes is None:
            return None
        weights, onednn, amx = step
        dec = meta.decodes
        caches = [c for kv in kv_caches for c in kv]
        return self._ext.decode_layers_bf16(x, h, weights, caches, *rope, meta.slot_mapping, dec.block_tables,
                                            dec.context_lens, stack.num_heads, stack.num_kv_heads, stack.eps,
                                            stack.head_dim ** -0.5, onednn, amx, self.onednn_row_bucket)

    def mixed_layers(self, x, h, stack, kv_caches, rope, attn, meta):
        """A step with prefill chunks (and any decodes beside them) of bfloat16 rows through the compiled
        attention, up to the last layer's attention output, in one call without the GIL: the same kernels in
        the same order as the layer loop, so the same numbers (`mixed_layers_bf16` in
        `kernels/csrc_decode_layers.cpp`). The linear layers as `decode_layers` picks them for the step's rows.
        Returns the residual stream and the last layer's attention output, or None for the layer loop: chunks
        on the masked path, or no copies for oneDNN where the rows need them."""
        step = self._stack_step(x, stack, attn, meta)
        if step is None or meta.chunks is None or meta.chunk_path == "masked":
            return None
        weights, onednn, amx = step
        none = x.new_empty(0, dtype=torch.int64)
        dec = meta.decodes
        decodes = [dec.tokens, dec.block_tables, dec.context_lens] if dec is not None else [none] * 3
        kc = {"kernel": meta.chunks, "split": meta.kernel_chunks}.get(meta.chunk_path)
        kernel = [kc.block_tables, kc.starts, kc.query_lens, kc.context_lens] if kc is not None else [none] * 4
        flash_len, flash_start, flash = 0, -1, [none, none]
        if meta.chunk_path in ("flash", "split"):
            fc = meta.flash_chunks
            flash_len = fc.max_query_len
            if isinstance(meta.flash_rows, slice):
                flash_start, flash = meta.flash_rows.start, [fc.block_tables, none]
            else:
                flash = [fc.block_tables, meta.flash_rows]
        caches = [c for kv in kv_caches for c in kv]
        return self._ext.mixed_layers_bf16(x, h, weights, caches, *rope, meta.slot_mapping, decodes + kernel + flash,
                                           flash_len, flash_start, stack.num_heads, stack.num_kv_heads, stack.eps,
                                           stack.head_dim ** -0.5, onednn, amx, self.onednn_row_bucket)

    def linear(self, x, weight, bias=None):
        """The compiled GEMV (row-major) for up to `gemv_max_rows` rows of bfloat16 (contiguous rows, on a
        CPU with AVX512-BF16): float32 sums, one rounding per output, as oneDNN's, but summed in another
        order, so a rare output is one bfloat16 step apart. With `prepack`'s copies: the GEMV over the VNNI copy up to
        `vnni_max_rows` rows, the AMX kernel over it up to `amx_max_rows` (where its columns are a multiple of
        32), oneDNN over the blocked one above, its rows padded to a multiple of `onednn_row_bucket`. `F.linear`
        for anything else (decided in C++)."""
        if self._packed and x.dim() == 2 and x.dtype == weight.dtype:
            rows = x.shape[0]
            entry = self._vnni.get(id(weight)) if rows <= max(self.vnni_max_rows, self.amx_max_rows) else None
            if entry is not None and entry[0] is weight:
                if rows <= self.vnni_max_rows:
                    return self._ext.linear_bf16(x, entry[1], bias, self.vnni_max_rows)
                if (weight.shape[1] % 32 == 0 and x.device.type == "cpu"
                        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))):
                    return self._ext.amx_linear_bf16(x, entry[1], bias)
            entry = self._packed.get(id(weight)) if rows > self.gemv_max_rows else None
            if entry is not None and entry[0] is weight:
                return linear_packed(x, entry[1], bias, self.onednn_row_bucket)
        return self._ext.linear_bf16(x, weight, bias, self.gemv_max_rows, self.f32_max_rows)

    def rms_norm(self, x, weight, eps):
        return self._ext.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return x, self._ext.add_rms_norm(x, residual, weight, eps)

    def rope_(self, x, cos_table, sin_table, positions):
        self._ext.rope_(x, cos_table, sin_table, positions)

    def silu_and_mul(self, gate_up):
        return self._ext.silu_and_mul(gate_up)

    def argmax(self, logits):
        # bfloat16 CPU logits with dense rows (the LM head's output): the compiled kernel, ~9x faster than
        # torch at 200 rows of a 49,152-token vocabulary on a 2-core Xeon (0.36 against 3.3 ms); else torch
        if (logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0
                and logits.stride(1) == 1):
            return self._ext.argmax_bf16(logits)
        return super().argmax(logits)


def packable(w: torch.Tensor) -> bool:
    """A weight `CppLayerOps.prepack` can pack: a 2-D bfloat16 CPU tensor, with oneDNN's bfloat16 path in this
    torch and on this CPU."""
    return (w.dim() == 2 and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.numel() > 0
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and onednn_bf16())


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  row_bucket: int = 1) -> torch.Tensor:
    """`F.linear` over a weight packed by `torch.ops.mkldnn._reorder_linear_weight`. `row_bucket` > 1 pads the
    rows with zeros up to a multiple of it and returns the real ones (a view), as the compiled decode stack's
    `linear_onednn` does, with the same bits."""
    if row_bucket < 1:
        raise ValueError(f"row_bucket must be at least 1, got {row_bucket}")
    rows = x.shape[0]
    padded = -(-rows // row_bucket) * row_bucket
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    xp = x.new_zeros(padded, x.shape[1])
    xp[:rows] = x
    return torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")[:rows]


def get_layer_ops(name: str = "auto") -> TorchLayerOps:
    """`torch`, `cpp`, or `auto` (the compiled ops when they build here, else torch)."""
    if name == "auto":
        try:
            return CppLayerOps()
        except Exception as e:  # no compiler or ninja: torch computes the same thing
            warnings.warn(f"compiled CPU layer ops unavailable ({e}); using torch", stacklevel=2)
            return TorchLayerOps()
    if name == "cpp":
        return CppLayerOps()
    if name == "torch":
        return TorchLayerOps()
    raise ValueError(f"unknown layer ops {name!r}; expected auto, cpp or torch")
