"""The fused norm-and-matmul kernels (`kernels/triton_linear.py`) against the separate kernels they replace,
at SmolLM2-135M's layer shapes, under several launch configs.

Per decoder layer the model runs two of them: the residual add, input norm, qkv projection (576 -> 960),
rotary embedding and K/V store (`TritonPagedAttention.project_qkv`), and the add, post-attention norm, gate/up
projection (576 -> 2 x 1536) and SiLU-and-multiply. Unfused, that is the Triton norm kernel, cuBLAS's GEMM and
the rotary-and-store kernel, or (for the MLP) the SiLU kernel. Between them o_proj and down run on cuBLAS, or
in the same kernel without the norm (`plain_matmuls`). This section captures every layer but its attention,
all 30 (2 in the dry run), in one CUDA graph, as a decode step's graph runs them, and times its replays at the
throughput section's batch for the separate kernels (`NORM_LINEAR_CONFIG = None`) and each config of a small
grid, whose outputs it checks against the separate kernels', then at one row for the default and the fastest.
The fastest config at the batch, if it beats the separate kernels by `APPLY_GAIN`, is set as
`NORM_LINEAR_CONFIG` for the sections after it; if none does, the separate kernels are (None). Then the config
applied, and the fastest with o_proj and down in the kernel, each with programmatic dependent launch and
without (`_pdl`): the fastest of those is applied if it beats the applied config. Last the separate kernels
with their small kernels (norms, rotary with the K/V store, SiLU-and-mul) launched with programmatic dependent
launch and without (`_small_pdl`, `triton_linear.SMALL_OPS_PDL`): the other way than the default is applied
where the separate kernels are and it wins by `PDL_GAIN`. The JSON says which the throughput section ran."""

from __future__ import annotations

import dataclasses

import torch

from loadtest.gpu_check.attention_sweep import PDL_GAIN
from loadtest.gpu_check.plan import Plan
from loadtest.gpu_check.timing import max_abs_diff, time_captured

APPLY_GAIN = 1.05
# (hidden, (heads, kv_heads, head_dim), intermediate): SmolLM2-135M's, and a tiny one for the dry run
SHAPE, SHAPE_DRY = (576, (9, 3, 64), 1536), (64, (2, 1, 32), 96)
# relative to the largest output: the matmul sums in another order than cuBLAS, and the gated output goes
# through SiLU and a product after two roundings to bfloat16
MAX_REL_DIFF = 0.03


def sweep_configs(dry_run: bool) -> list:
    from kernels.triton_linear import LinearConfig

    if dry_run:
        return [LinearConfig(block_m=16, block_n=16, block_k=16), LinearConfig(block_m=16, block_n=32, block_k=32),
                LinearConfig(block_m=16, block_n=32, block_k=32, plain_matmuls=True)]
    shapes = (dict(), dict(block_m=16), dict(block_n=128), dict(block_m=64), dict(block_n=32), dict(block_k=128),
              dict(block_m=64, block_n=128, num_warps=8),
              # deeper: the matmul loop's tiles (num_stages - 1) in flight, two at the default 3 stages; at hidden
              # 576 a program's whole reduction is 9 tiles of 64 (5 of 128), each waiting on memory's latency
              dict(num_stages=4), dict(num_stages=5), dict(block_k=128, num_stages=4))
    # each with cuBLAS's o_proj and down, and five with the kernel's (down reduces over 1,536: 24 tiles of 64)
    # (each config compiles ~6 kernels)
    plain = shapes[:3] + shapes[-2:]
    return [LinearConfig(**c) for c in shapes] + [LinearConfig(**c, plain_matmuls=True) for c in plain]


def _inputs(rows: int, shape: tuple, layers: int, device: torch.device, seed: int = 0) -> dict:
    from kernels.triton_attention import TritonAttentionMetadata

    hidden, (heads, kv_heads, head_dim), inter = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=torch.bfloat16)

    positions = 1024
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([torch.arange(positions).float()[:, None] * inv[None]] * 2, dim=-1)
    rope = (emb.cos().to(device=device, dtype=torch.bfloat16), emb.sin().to(device=device, dtype=torch.bfloat16),
            torch.randint(0, positions, (rows,), generator=gen).to(device))
    blocks = -(-rows // 16)
    return {"x": randn(rows, hidden, scale=3.0), "residual": randn(rows, hidden), "attn_out": randn(rows, hidden),
            "norms": [randn(hidden, scale=0.1) + 1 for _ in range(2)], "heads": (heads, kv_heads), "rope": rope,
            "meta": TritonAttentionMetadata(torch.randperm(blocks * 16, generator=gen)[:rows].to(device), None, None,
                                            None),
            "caches": [(randn(blocks, 16, kv_heads, head_dim), randn(blocks, 16, kv_heads, head_dim))
                       for _ in range(layers)],
            "qkv": [randn((heads + 2 * kv_heads) * head_dim, hidden, scale=hidden ** -0.5) for _ in range(layers)],
            "o_proj": [randn(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5) for _ in range(layers)],
            "gate_up": [randn(2 * inter, hidden, scale=hidden ** -0.5) for _ in range(layers)],
            "down": [randn(hidden, inter, scale=inter ** -0.5) for _ in range(layers)]}


def _layers(attn, ops, a: dict) -> list[torch.Tensor]:
    """Every layer but its attention, each with its own weights and caches as a step reads them: the layer's
    input (`project_qkv`: the add, norm, qkv projection, rotary and K/V store), o_proj (of the queries, standing
    in for attention's output), the MLP's input (`norm_gate_up`) and down. Returns the queries, each layer's
    keys and values, o_proj's and the MLP's outputs."""
    outs = []
    for qkv, o_proj, gate_up, down, (k_cache, v_cache) in zip(a["qkv"], a["o_proj"], a["gate_up"], a["down"],
                                                              a["caches"]):
        x, q = attn.project_qkv(a["x"], a["residual"], a["norms"][0], 1e-5, qkv, None, *a["heads"], a["rope"], ops,
                                k_cache, v_cache, a["meta"])
        o = ops.linear(q.reshape(q.shape[0], -1), o_proj)
        m = ops.linear(ops.norm_gate_up(x, o, a["norms"][1], 1e-5, gate_up)[1], down)
        outs += [q, o, m, k_cache, v_cache]
    return outs


def _pdl(plan: Plan, attn, ops, configs: list, shape: tuple, layers: int, device: torch.device,
         repeats: int) -> dict:
    """Each of `configs` (the one applied, else the default; then the fastest with o_proj and down in the
    kernel too, whose every launch in a layer then overlaps the one before) at the batch with programmatic
    dependent launch (`LinearConfig.pdl`: each fused kernel's programs start while the kernel before ends, then
    wait for it) and without, in the layers' graph. Each one's outputs must be the same to the bit both ways (a
    difference would be a kernel reading what the one before had not written yet). `choice`: the fastest of
    them if it beats the first config without by `PDL_GAIN`, else the first."""
    from kernels import triton_linear

    saved = triton_linear.NORM_LINEAR_CONFIG
    result: dict = {"configs": [], "ok": True}
    a = _inputs(plan.batch, shape, layers, device)
    try:
        for config in configs:
            row: dict = {"config": dataclasses.asdict(config)}
            try:
                triton_linear.NORM_LINEAR_CONFIG = config
                off_s, reference = time_captured(lambda: _layers(attn, ops, a), device, repeats)
                triton_linear.NORM_LINEAR_CONFIG = dataclasses.replace(config, pdl=True)
                on_s, outs = time_captured(lambda: _layers(attn, ops, a), device, repeats)
                diff = max_abs_diff(outs, reference)
                row |= {"us": off_s * 1e6, "pdl_us": on_s * 1e6, "max_abs_diff": diff, "ok": diff == 0.0}
            except Exception as e:  # a launch the driver refuses, a capture that fails
                row |= {"ok": False, "error": f"{type(e).__name__}: {e}"}
            result["configs"].append(row)
    finally:
        triton_linear.NORM_LINEAR_CONFIG = saved
    rows = result["configs"]
    result["ok"] = all(r["ok"] for r in rows)
    timed = [(r["us"], r["config"], False) for r in rows if r["ok"]] + [(r["pdl_us"], r["config"], True)
                                                                        for r in rows if r["ok"]]
    first = rows[0]
    if first["ok"] and timed:
        us, config, pdl = min(timed, key=lambda t: t[0])
        if us * PDL_GAIN <= first["us"] and not plan.dry_run:
            result["choice"] = {**config, "pdl": pdl}
    result.setdefault("choice", first["config"])
    result["applied"] = result["choice"] != first["config"]
    return result


def _small_pdl(plan: Plan, attn, ops, shape: tuple, layers: int, device: torch.device, repeats: int,
               apply: bool) -> dict:
    """The separate kernels' layers at the batch with their small kernels launched with programmatic dependent
    launch (`triton_linear.SMALL_OPS_PDL`: each one's programs start while the kernel before ends, then wait
    for it) and without. The outputs must be the same to the bit. The other way than the default is kept for
    the sections after if `PDL_GAIN` faster and `apply` (the separate kernels are what they run)."""
    from kernels import triton_linear

    saved = triton_linear.NORM_LINEAR_CONFIG, triton_linear.SMALL_OPS_PDL
    result: dict = {"default": saved[1], "applied": False, "pdl": saved[1], "ok": True}
    a = _inputs(plan.batch, shape, layers, device)
    try:
        triton_linear.NORM_LINEAR_CONFIG, triton_linear.SMALL_OPS_PDL = None, False
        off_s, reference = time_captured(lambda: _layers(attn, ops, a), device, repeats)
        triton_linear.SMALL_OPS_PDL = True
        on_s, outs = time_captured(lambda: _layers(attn, ops, a), device, repeats)
        diff = max_abs_diff(outs, reference)
    except Exception as e:  # a launch the driver refuses, a capture that fails
        return result | {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        triton_linear.NORM_LINEAR_CONFIG, triton_linear.SMALL_OPS_PDL = saved
    result |= {"us": off_s * 1e6, "pdl_us": on_s * 1e6, "max_abs_diff": diff, "ok": diff == 0.0}
    faster = True if on_s * PDL_GAIN <= off_s else False if off_s * PDL_GAIN <= on_s else saved[1]
    if result["ok"] and apply and faster != saved[1] and not plan.dry_run:
        triton_linear.SMALL_OPS_PDL = faster
        result |= {"applied": True, "pdl": faster}
    return result


def sweep(plan: Plan, repeats: int = 50) -> dict:
    """Per row count: the separate kernels' time per step (all layers' two ops), and each config's with its
    largest relative difference from them. Applies the fastest at the batch (see the module docstring)."""
    from kernels import triton_linear
    from kernels.triton_attention import TritonPagedAttention
    from kernels.triton_layer_ops import TritonLayerOps

    device = torch.device(plan.device)
    shape, layers = (SHAPE_DRY if plan.dry_run else SHAPE), plan.sweep_layers
    ops, attn = TritonLayerOps(), TritonPagedAttention(device)
    configs = sweep_configs(plan.dry_run)
    default = triton_linear.NORM_LINEAR_CONFIG
    by_rows = {}
    try:
        for rows in (plan.batch, 1):  # at one row: the default, and the fastest at the batch
            if rows == 1:
                fastest = min((r for r in by_rows[plan.batch]["configs"] if r.get("ok")), key=lambda r: r["us"],
                              default=None)
                configs = [c for c in configs
                           if c == default or (fastest and dataclasses.asdict(c) == fastest["config"])]
            a = _inputs(rows, shape, layers, device)
            triton_linear.NORM_LINEAR_CONFIG = None
            base_s, reference = time_captured(lambda: _layers(attn, ops, a), device, repeats)
            scale = max(r.float().abs().max().item() for r in reference)
            table = []
            for config in configs:
                row: dict = {"config": dataclasses.asdict(config)}
                try:
                    triton_linear.NORM_LINEAR_CONFIG = config
                    seconds, outs = time_captured(lambda: _layers(attn, ops, a), device, repeats)
                    diff = max_abs_diff(outs, reference) / scale
                    row |= {"us": seconds * 1e6, "max_rel_diff": diff, "ok": diff <= MAX_REL_DIFF,
                            "speedup": base_s / seconds}
                except Exception as e:  # a config that does not compile or launch here
                    row |= {"ok": False, "error": f"{type(e).__name__}: {e}"}
                table.append(row)
            by_rows[rows] = {"separate_us": base_s * 1e6, "configs": table}
    finally:
        triton_linear.NORM_LINEAR_CONFIG = default
    at_batch = by_rows[plan.batch]
    good = [r for r in at_batch["configs"] if r.get("ok")]
    best = min(good, key=lambda r: r["us"]) if good else None
    # a dry run's timings (each one call, in Triton's interpreter) decide nothing, as in the other sweeps
    if best is not None and best["us"] * APPLY_GAIN <= at_batch["separate_us"] and not plan.dry_run:
        choice = best["config"]
    else:
        choice = None
    applied = None if choice is None else triton_linear.LinearConfig(**choice)
    candidates = [applied or default or triton_linear.LinearConfig()]
    plain = min((r for r in good if r["config"]["plain_matmuls"]), key=lambda r: r["us"], default=None)
    if plain is not None and not candidates[0].plain_matmuls:
        candidates.append(triton_linear.LinearConfig(**plain["config"]))
    pdl = _pdl(plan, attn, ops, candidates, shape, layers, device, repeats)
    if applied is None:  # the separate kernels won: measured, not applied
        pdl["applied"] = False
    elif pdl["applied"]:
        applied = triton_linear.LinearConfig(**pdl["choice"])
    if not plan.dry_run:
        triton_linear.NORM_LINEAR_CONFIG = applied
    small_pdl = _small_pdl(plan, attn, ops, shape, layers, device, repeats, apply=applied is None)
    passed = (all(r.get("ok") or "error" in r for rows in by_rows.values() for r in rows["configs"]) and bool(good)
              and pdl["ok"] and small_pdl["ok"])
    return {"passed": passed, "layers": layers, "pdl": pdl, "small_ops_pdl": small_pdl,
            "shape": dict(zip(("hidden", "heads_kv_heads_head_dim", "intermediate"), shape)),
            "default": None if default is None else dataclasses.asdict(default), "best_at_batch": best,
            "applied": "separate kernels" if applied is None else dataclasses.asdict(applied),
            "applied_to_later_sections": not plan.dry_run,
            "rows": {str(k): v for k, v in by_rows.items()}}
