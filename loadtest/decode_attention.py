"""How fast the compiled decode attention reads the paged KV cache, against a plain read of memory in the same
run: `kvrelay bench decode-attention --batch 256 --context 200 --out docs/results`.

The cache gets the default model's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16),
each request's blocks scattered over a pool, and context lengths drawn from [context - 60, context] as in a
burst's decode steps. The kernel's rate is the K and V bytes of every request's context over its best time;
the ceiling is `torch.sum` over a 256 MiB buffer on the same threads, as `loadtest.ceilings` measures it.

A model's decode step reads every layer's K/V once, so one layer's comes back from memory, not from the
cache. The bench does the same with `--layers`: that many caches, each with its own scattered blocks, called
in turn (one timed call is a sweep over all of them). By default, enough layers that a sweep reads twice
the last-level cache (at most 128): with one layer, a host with a large L3 (480 MiB on one Intel guest) keeps
the whole K/V cached between calls, and the bench measures the cache."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from loadtest.results import git_commit, loadavg, write_json


def _best(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


MAX_AUTO_LAYERS = 128


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache sysfs lists for cpu0, or None."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes) if sizes else None


def auto_layers(touched_bytes: int, llc_bytes: int | None) -> int:
    """Layers whose K/V together are twice the last-level cache (64 MiB when unknown), 1 to 128."""
    target = 2 * (llc_bytes or 64 * 2**20)
    return max(1, min(MAX_AUTO_LAYERS, -(-target // max(1, touched_bytes))))


def run_decode_attention(args: argparse.Namespace) -> int:
    layers_given = args.layers is not None
    if min(args.batch, args.context, args.repeats, args.rounds, args.threads) < 1 or (layers_given and args.layers < 1):
        raise ValueError("--batch, --context, --threads, --rounds, --repeats and --layers must be >= 1")
    import torch

    from kernels.cpp_attention import CppPagedAttention
    from kernels.cpu_extension import load_extension
    from workers.huge_pages import zeros_on_huge_pages

    ext = load_extension()
    if not ext.has_avx512_bf16():
        raise ValueError("this CPU has no AVX512-BF16: the compiled bfloat16 decode kernel is not built")
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim, block = args.heads, args.kv_heads, args.head_dim, args.block_size
    gen = torch.Generator().manual_seed(0)
    per_request = -(-args.context // block)
    block_bytes = block * kv_heads * dim * 2
    llc = last_level_cache_bytes()
    layers = args.layers if layers_given else auto_layers(args.batch * per_request * block_bytes * 2, llc)
    pool = args.batch * per_request * 2 if layers > 1 else max(args.batch * per_request * 2, 64 * 2**20 // block_bytes)
    def cache() -> torch.Tensor:  # on huge pages where the engine's cache is (workers/huge_pages.py)
        t = zeros_on_huge_pages(pool, block, kv_heads, dim, dtype=torch.bfloat16, device=torch.device("cpu"))
        return t.copy_(torch.randn(pool, block, kv_heads, dim, generator=gen))

    caches = [(cache(), cache()) for _ in range(layers)]
    tables = [torch.randperm(pool, generator=gen)[:args.batch * per_request].view(args.batch, per_request).contiguous()
              for _ in range(layers)]
    lens = torch.randint(max(1, args.context - 60), args.context + 1, (args.batch,), generator=gen)
    q = torch.randn(args.batch, heads, dim, generator=gen).bfloat16()
    scale = dim ** -0.5
    if not CppPagedAttention().takes_bf16(q.dtype, dim):
        raise ValueError(f"head_dim {dim} does not take the bfloat16 kernel (a multiple of 32, at most 256)")
    kv_bytes = int(lens.sum()) * kv_heads * dim * 2 * 2  # per layer
    buffer = torch.ones(256 * 2**20 // 4)

    def sweep() -> None:
        for (k, v), table in zip(caches, tables):
            ext.paged_decode_attention_bf16(q, k, v, table, lens, scale)

    load = [loadavg()]
    kernel_s, read_s = [], []
    with torch.inference_mode():
        for _ in range(args.rounds):  # interleaved, so that the machine's load hits both alike
            kernel_s.append(_best(sweep, args.repeats) / layers)
            read_s.append(_best(buffer.sum, max(3, args.repeats // 4)))
    load.append(loadavg())
    kernel_gbs, read_gbs = kv_bytes / min(kernel_s) / 1e9, buffer.numel() * 4 / min(read_s) / 1e9
    print(f"decode attention, {args.batch} requests, context <= {args.context}, {args.threads} threads, {layers} "
          f"layer{'s' if layers > 1 else ''}: {min(kernel_s) * 1e3:.2f} ms a layer, {kernel_gbs:.1f} GB/s of K/V; "
          f"memory read {read_gbs:.1f} GB/s; {kernel_gbs / read_gbs:.2f} of the read ceiling")
    if llc is not None and kv_bytes * layers <= llc:
        print(f"note: the K/V of all {layers} layer(s), {kv_bytes * layers / 2**20:.0f} MiB, fit in the last-level "
              f"cache ({llc / 2**20:.0f} MiB): this measures the cache, not memory")
    payload = {"benchmark": "decode-attention", "command": "kvrelay bench " + " ".join(args.argv),
               "commit": git_commit(), "batch": args.batch, "context": args.context, "heads": heads,
               "kv_heads": kv_heads, "head_dim": dim, "block_size": block, "threads": args.threads,
               "layers": layers, "last_level_cache_bytes": llc,
               "kv_bytes": kv_bytes, "kernel_ms": [round(t * 1e3, 4) for t in kernel_s],
               "read_gbs": round(read_gbs, 2), "kernel_gbs": round(kernel_gbs, 2),
               "fraction_of_read": round(kernel_gbs / read_gbs, 3), "loadavg_1_5_15": load}
    if args.out is not None:
        path = write_json(args.out / f"decode-attention-{time.strftime('%Y%m%d-%H%M%S')}.json", payload)
        print(f"wrote {path}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("decode-attention", help="the compiled decode attention's K/V read rate against a plain "
                       "memory read, same run")
    p.add_argument("--batch", type=int, default=256, help="requests (one query each)")
    p.add_argument("--context", type=int, default=200, help="longest context; lengths are drawn from [C - 60, C]")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--rounds", type=int, default=3, help="rounds of kernel and read, interleaved")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per round (the best counts)")
    p.add_argument("--layers", type=int, default=None,
                   help="layer caches called in turn, as a decode step reads them (default: enough to read twice "
                   f"the last-level cache, at most {MAX_AUTO_LAYERS}); 1 re-reads one layer's K/V, which a large "
                   "cache keeps")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON result (default: print only)")
