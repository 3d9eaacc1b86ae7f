"""The decode attention kernel alone at the throughput section's shape, under several launch configs.

A batch-256 decode step of SmolLM2-135M's shape on an H200 spent ~0.55 ms of its 1.5 ms of device time in
the paged attention (30 launches reading the KV at 1.1-1.4 TB/s, a third of the copy bandwidth): each program
walks ~200 keys of one sequence 32 at a time, one dependent gather after another. This section times the
kernel over the same shape (256 sequences of 128-256 tokens, 9 query / 3 KV heads of 64, bf16, blocks of 16
scattered over the cache) as a decode step runs it: one launch per layer, each over its own layer's cache
(30, 1.1 GB in all, more than the GPU's L2 holds), captured in one CUDA graph and timed over its replays
(`timing.time_captured`: launched one by one from Python, the host would set the pace). For each
`LaunchConfig` of a small grid it checks the outputs against the default's, and reports the time per launch
and the K/V bytes read per second against the copy bandwidth. The fastest, if it beats the default by
`APPLY_GAIN`, is set as `DECODE_CONFIG` for the sections after it, so that the throughput section measures
the engine with it (the JSON says which config each measured). Then one sequence's step (a single stream) is
timed with that config unsplit and with automatic splits (`num_splits=0`, the default's, which leave a full
batch as it is), and the faster way kept if it is that much faster. Last, that config with programmatic
dependent launch (the default's) and without (`_pdl`)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from loadtest.gpu_check.plan import Plan, TOLERANCE
from loadtest.gpu_check.timing import max_abs_diff, time_captured

APPLY_GAIN = 1.1
PDL_GAIN = 1.03  # programmatic dependent launch: kept if this much faster (it changes nothing else)
# Pipeline stages by `LaunchConfig.prefetch` (compiled for sm_90, triton 3.6 and 3.7): with it (the default)
# the keys and values get `num_stages - 1` shared-memory buffers, two tiles in flight at 3 stages, three at 4
GRID = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (3, 4)}
# beside the grid: a sequence's keys (~190 on average at the throughput shape) in one or two tiles, all their
# loads in flight at once, fewer warps per program (more programs resident per SM), and four tiles in flight
EXTRA = [(256, 8, 2), (256, 8, 3), (256, 4, 2), (64, 2, 3), (128, 2, 3), (32, 4, 5),
         # each sequence's keys split between 2 or 4 programs, combined by a second kernel
         (32, 4, 3, 2), (64, 4, 3, 2), (32, 4, 3, 4), (64, 4, 2, 4)]
# without `prefetch`: each tile's block ids, then its keys, loaded in its own iteration (a chain: one buffer up
# to 4 stages, a round trip per tile; two at 5, three at 7); (32, 4, 3) is what the last lease measured
CHAIN = [(32, 4, 3), (32, 4, 5), (32, 4, 7), (32, 4, 5, 2)]
EXTRA_DRY = [(16, 4, 3, 2)]
CHAIN_DRY = [(16, 4, 3)]
GRID_DRY = {"block_n": (16, 32), "num_warps": (4,), "num_stages": (3,)}


def _inputs(plan: Plan, device: torch.device, seed: int = 0, batch: int | None = None) -> dict:
    """A decode batch (`plan.batch` sequences unless given) over a cache whose blocks are handed out in a
    shuffled order, as a busy pool does; the cache repeated for each of `plan.sweep_layers` layers, at their
    own addresses, as a step reads them."""
    heads, kv_heads, head_dim = (9, 3, 64) if not plan.dry_run else (4, 2, 32)
    batch = plan.batch if batch is None else batch
    low, high = plan.prompt_len, plan.prompt_len + plan.output_len
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high + 1, (batch,), generator=gen)
    block_size = 16
    blocks_per_seq = -(-lens // block_size)
    total = int(blocks_per_seq.sum())
    order = torch.randperm(total, generator=gen)
    width = int(blocks_per_seq.max())
    tables = torch.zeros(batch, width, dtype=torch.long)
    at = 0
    for i, n in enumerate(blocks_per_seq.tolist()):
        tables[i, :n] = order[at:at + n]
        at += n
    dtype, layers = torch.bfloat16, plan.sweep_layers

    def cache() -> torch.Tensor:  # [layers, blocks, block_size, kv_heads, head_dim]
        one = torch.randn(total, block_size, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        return one.unsqueeze(0).repeat(layers, 1, 1, 1, 1)

    k, v = cache(), cache()
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return {"query": q, "k_cache": k, "v_cache": v, "block_tables": tables.to(device),
            "seq_lens": lens.to(device), "query_start_loc": torch.arange(batch + 1, device=device),
            "kv_bytes": int(lens.sum()) * 2 * kv_heads * head_dim * 2, "context_tokens": int(lens.sum())}


def sweep_configs(dry_run: bool) -> list:
    """The launch configs the sweep times (besides the default): the grid, then the extras; each the default
    (`DECODE_CONFIG`) with its tile, warps and stages (and splits, where given) replaced, so that they launch as
    it does otherwise (programmatic dependent launch, automatic splits)."""
    from kernels.triton_attention import DECODE_CONFIG

    def config(values: tuple, **more) -> object:
        return dataclasses.replace(DECODE_CONFIG, **dict(zip(("block_n", "num_warps", "num_stages", "num_splits"),
                                                             values)), **more)

    grid = GRID_DRY if dry_run else GRID
    return ([config(values) for values in itertools.product(*grid.values())]
            + [config(values) for values in (EXTRA_DRY if dry_run else EXTRA)]
            + [config(values, prefetch=False) for values in (CHAIN_DRY if dry_run else CHAIN)])


def sweep(plan: Plan, repeats: int = 50) -> dict:
    """Each config of the grid: seconds per launch, bytes per second, and its largest difference from the
    default config's output. Applies the fastest (see the module docstring)."""
    from kernels import triton_attention as ta
    from loadtest.gpu_check.throughput import copy_bandwidth

    device = torch.device(plan.device)
    bandwidth = copy_bandwidth(device, plan.copy_bytes)
    x = _inputs(plan, device)
    scale = x["query"].shape[-1] ** -0.5
    default = ta.DECODE_CONFIG

    def launch(config: ta.LaunchConfig, x: dict = x) -> list[torch.Tensor]:
        """A step's attention: one launch per layer, each over its own layer's cache."""
        return [ta.paged_attention(x["query"], k, v, torch.empty_like(x["query"]), x["block_tables"], x["seq_lens"],
                                   x["query_start_loc"], scale, config) for k, v in zip(x["k_cache"], x["v_cache"])]

    reference = launch(default)
    configs = sweep_configs(plan.dry_run)
    if default not in configs:
        configs.insert(0, default)
    rows = []
    for config in configs:
        row: dict = {"config": dataclasses.asdict(config)}
        try:
            seconds, outs = _per_launch(plan, device, launch, config, x, repeats)
            diff = max_abs_diff(outs, reference)
            row |= {"max_abs_diff": diff, "ok": diff <= TOLERANCE["bfloat16"], "us": seconds * 1e6,
                    "kv_gb_s": x["kv_bytes"] / seconds / 1e9, "of_copy_bandwidth": x["kv_bytes"] / seconds / bandwidth}
        except Exception as e:  # a config that does not compile or launch here
            row |= {"ok": False, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
    good = [r for r in rows if r.get("ok")]
    base = next(r for r in rows if r["config"] == dataclasses.asdict(default))
    best = min(good, key=lambda r: r["us"]) if good else None
    applied = None
    if best is not None and base.get("us") and best["us"] * APPLY_GAIN <= base["us"] and not plan.dry_run:
        applied = best["config"]
        ta.DECODE_CONFIG = ta.LaunchConfig(**applied)
    one = _one_sequence(plan, device, launch, ta.DECODE_CONFIG, repeats)
    pdl = _pdl(plan, device, launch, x, repeats)
    return {"passed": (base.get("ok", False) and all(r.get("ok") or "error" in r for r in rows) and one["ok"]
                       and pdl["ok"]),
            "batch": plan.batch, "layers": plan.sweep_layers, "context_tokens": x["context_tokens"],
            "kv_bytes": x["kv_bytes"], "copy_bandwidth_gb_s": bandwidth / 1e9,
            "default": dataclasses.asdict(default), "best": best, "applied": applied, "configs": rows,
            "one_sequence": one, "pdl": pdl}


def _per_launch(plan: Plan, device: torch.device, launch, config, x: dict,
                repeats: int) -> tuple[float, list[torch.Tensor]]:
    """Seconds per launch of `config`: `launch`'s step over `x` (one launch per layer) captured in one graph
    and timed over its replays (`time_captured`); and the step's outputs."""
    seconds, outs = time_captured(lambda: launch(config, x), device, repeats)
    return seconds / plan.sweep_layers, outs


def _pdl(plan: Plan, device: torch.device, launch, x: dict, repeats: int) -> dict:
    """The config the sections after will run, at the batch, with programmatic dependent launch
    (`LaunchConfig.pdl`: each launch's programs start while the one before ends, then wait for it) and without,
    a step's worth in one graph, launched back to back as a step's layers launch it. The output must be the same
    to the bit (the kernel computes the same; a difference would be a launch reading what the one before had
    not written yet). The other way than the config's (on by default) is kept for the sections after if
    `PDL_GAIN` faster (`applied`; `pdl` says which way they run). Where the device has no such launch (before
    sm_90, the interpreter) both run alike."""
    from kernels import triton_attention as ta

    config = ta.DECODE_CONFIG
    off, on = dataclasses.replace(config, pdl=False), dataclasses.replace(config, pdl=True)
    result: dict = {"config": dataclasses.asdict(config), "applied": False, "pdl": config.pdl, "ok": True}
    try:
        off_s, reference = _per_launch(plan, device, launch, off, x, repeats)
        on_s, outs = _per_launch(plan, device, launch, on, x, repeats)
        diff = max_abs_diff(outs, reference)
    except Exception as e:
        return result | {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result |= {"us": off_s * 1e6, "pdl_us": on_s * 1e6, "max_abs_diff": diff, "ok": diff == 0.0}
    faster = on if on_s * PDL_GAIN <= off_s else off if off_s * PDL_GAIN <= on_s else config
    if result["ok"] and faster != config and not plan.dry_run:
        ta.DECODE_CONFIG = faster
        result |= {"applied": True, "pdl": faster.pdl}
    return result


def _one_sequence(plan: Plan, device: torch.device, launch, config, repeats: int) -> dict:
    """One sequence's decode step (a single stream: 3 programs for the GPU's SMs) under `config` unsplit
    (`num_splits=1`) and with automatic splits (`num_splits=0`, the default's; they leave a full batch as it
    is). If the other way than the config's is `APPLY_GAIN` faster and gives the same output, it is set for the
    sections after (the throughput section's single stream); a config with a fixed count of splits is left as
    it is."""
    from kernels import triton_attention as ta

    x = _inputs(plan, device, seed=1, batch=1)
    plain_config, auto = dataclasses.replace(config, num_splits=1), dataclasses.replace(config, num_splits=0)
    result: dict = {"context_tokens": x["context_tokens"], "config": dataclasses.asdict(config), "applied": False,
                    "ok": True}
    if config.num_splits > 1:
        return result | {"skipped": "the config splits every step"}
    try:
        plain_s, plain = _per_launch(plan, device, launch, plain_config, x, repeats)
        auto_s, outs = _per_launch(plan, device, launch, auto, x, repeats)
        diff = max_abs_diff(outs, plain)
    except Exception as e:
        return result | {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result |= {"splits": ta.decode_splits(auto, 1, x["k_cache"].shape[-2], device), "us": plain_s * 1e6,
               "auto_splits_us": auto_s * 1e6, "max_abs_diff": diff, "ok": diff <= TOLERANCE["bfloat16"],
               "auto_splits": config.num_splits == 0}
    faster = (auto if auto_s * APPLY_GAIN <= plain_s else plain_config if plain_s * APPLY_GAIN <= auto_s
              else config)
    if result["ok"] and faster != config and not plan.dry_run:
        ta.DECODE_CONFIG = faster
        result |= {"applied": True, "auto_splits": faster.num_splits == 0}
    return result
