"""How fast the compiled decode attention reads the paged KV cache, against a plain read of memory in the same
run: `kvrelay bench decode-attention --batch 256 --context 200 --out docs/results`.

The cache gets the default model's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16),
each request's blocks scattered over a pool larger than the last-level cache, and context lengths drawn
from [context - 60, context] as in a burst's decode steps. The kernel's rate is the K and V bytes of every
request's context over its best time; the ceiling is `torch.sum` over a 256 MiB buffer on the same threads,
as `loadtest.ceilings` measures it."""

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


def run_decode_attention(args: argparse.Namespace) -> int:
    if min(args.batch, args.context, args.repeats, args.rounds, args.threads) < 1:
        raise ValueError("--batch, --context, --threads, --rounds and --repeats must be >= 1")
    import torch

    from kernels.cpp_attention import CppPagedAttention
    from kernels.cpu_extension import load_extension

    ext = load_extension()
    if not ext.has_avx512_bf16():
        raise ValueError("this CPU has no AVX512-BF16: the compiled bfloat16 decode kernel is not built")
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim, block = args.heads, args.kv_heads, args.head_dim, args.block_size
    gen = torch.Generator().manual_seed(0)
    per_request = -(-args.context // block)
    pool = max(args.batch * per_request * 2, 64 * 2**20 // (block * kv_heads * dim * 2))  # past the LLC
    k = torch.randn(pool, block, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(pool, block, kv_heads, dim, generator=gen).bfloat16()
    tables = torch.randperm(pool, generator=gen)[:args.batch * per_request].view(args.batch, per_request).contiguous()
    lens = torch.randint(max(1, args.context - 60), args.context + 1, (args.batch,), generator=gen)
    q = torch.randn(args.batch, heads, dim, generator=gen).bfloat16()
    scale = dim ** -0.5
    if not CppPagedAttention().takes_bf16(q.dtype, dim):
        raise ValueError(f"head_dim {dim} does not take the bfloat16 kernel (a multiple of 32, at most 256)")
    kv_bytes = int(lens.sum()) * kv_heads * dim * 2 * 2
    buffer = torch.ones(256 * 2**20 // 4)
    load = [loadavg()]
    kernel_s, read_s = [], []
    with torch.inference_mode():
        for _ in range(args.rounds):  # interleaved, so that the machine's load hits both alike
            kernel_s.append(_best(lambda: ext.paged_decode_attention_bf16(q, k, v, tables, lens, scale), args.repeats))
            read_s.append(_best(buffer.sum, max(3, args.repeats // 4)))
    load.append(loadavg())
    kernel_gbs, read_gbs = kv_bytes / min(kernel_s) / 1e9, buffer.numel() * 4 / min(read_s) / 1e9
    print(f"decode attention, {args.batch} requests, context <= {args.context}, {args.threads} threads: "
          f"{min(kernel_s) * 1e3:.2f} ms, {kernel_gbs:.1f} GB/s of K/V; memory read {read_gbs:.1f} GB/s; "
          f"{kernel_gbs / read_gbs:.2f} of the read ceiling")
    payload = {"benchmark": "decode-attention", "command": "kvrelay bench " + " ".join(args.argv),
               "commit": git_commit(), "batch": args.batch, "context": args.context, "heads": heads,
               "kv_heads": kv_heads, "head_dim": dim, "block_size": block, "threads": args.threads,
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
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON result (default: print only)")
