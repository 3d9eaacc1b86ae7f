"""The decode attention kernel alone at the throughput section's shape, under several launch configs.

A batch-256 decode step of SmolLM2-135M's shape on an H200 spent ~0.55 ms of its 1.5 ms of device time in
the paged attention (30 launches reading the KV at 1.1-1.4 TB/s, a third of the copy bandwidth): each program
walks ~200 keys of one sequence 32 at a time, one dependent gather after another. This section times the
kernel over the same shape (256 sequences of 128-256 tokens, 9 query / 3 KV heads of 64, bf16, blocks of 16
scattered over the cache) for each `LaunchConfig` of a small grid, checks each one's output against the
default's, and reports the K/V bytes read per second against the copy bandwidth. The fastest, if it beats the
default by `APPLY_GAIN`, is set as `DECODE_CONFIG` for the sections after it, so that the throughput section
measures the engine with it (the JSON says which config each measured)."""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from loadtest.gpu_check.plan import Plan, TOLERANCE

APPLY_GAIN = 1.1
GRID = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}
# beside the grid: a sequence's keys (~190 on average at the throughput shape) in one or two tiles, all their
# loads in flight at once, and fewer warps per program (more programs resident per SM)
EXTRA = [(256, 8, 2), (256, 8, 3), (256, 4, 2), (64, 2, 3), (128, 2, 3),
         # each sequence's keys split between 2 or 4 programs, combined by a second kernel
         (32, 4, 3, 2), (64, 4, 3, 2), (32, 4, 3, 4), (64, 4, 2, 4)]
EXTRA_DRY = [(16, 4, 3, 2)]
GRID_DRY = {"block_n": (16, 32), "num_warps": (4,), "num_stages": (3,)}


def _inputs(plan: Plan, device: torch.device, seed: int = 0) -> dict:
    """A decode batch over a cache whose blocks are handed out in a shuffled order, as a busy pool does."""
    heads, kv_heads, head_dim = (9, 3, 64) if not plan.dry_run else (4, 2, 32)
    batch = plan.batch
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
    dtype = torch.bfloat16
    k = torch.randn(total, block_size, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(total, block_size, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return {"query": q, "k_cache": k, "v_cache": v, "block_tables": tables.to(device),
            "seq_lens": lens.to(device), "query_start_loc": torch.arange(batch + 1, device=device),
            "kv_bytes": int(lens.sum()) * 2 * kv_heads * head_dim * 2, "context_tokens": int(lens.sum())}


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / repeats
    start_s = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start_s) / repeats


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

    def launch(config: ta.LaunchConfig) -> torch.Tensor:
        out = torch.empty_like(x["query"])
        return ta.paged_attention(x["query"], x["k_cache"], x["v_cache"], out, x["block_tables"], x["seq_lens"],
                                  x["query_start_loc"], scale, config)

    reference = launch(default).float()
    grid = GRID_DRY if plan.dry_run else GRID
    configs = [ta.LaunchConfig(*values) for values in itertools.product(*grid.values())]
    configs += [ta.LaunchConfig(*values) for values in (EXTRA_DRY if plan.dry_run else EXTRA)]
    if default not in configs:
        configs.insert(0, default)
    rows = []
    for config in configs:
        row: dict = {"config": dataclasses.asdict(config)}
        try:
            diff = (launch(config).float() - reference).abs().max().item()
            seconds = _time(lambda: launch(config), device, repeats if not plan.dry_run else 1)
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
    return {"passed": base.get("ok", False) and all(r.get("ok") or "error" in r for r in rows),
            "batch": plan.batch, "context_tokens": x["context_tokens"], "kv_bytes": x["kv_bytes"],
            "copy_bandwidth_gb_s": bandwidth / 1e9,
            "default": dataclasses.asdict(default), "best": best, "applied": applied, "configs": rows}
