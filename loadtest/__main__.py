"""CLI: ``python -m loadtest burst --cap 64 --systems engine,hf-static --out results/``.

Runs the chosen systems one after another in this process, prints a comparison
table and writes every metric to a JSON file under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from loadtest.results import RunResult, format_table, git_commit, loadavg, write_json
from loadtest.workloads import BURST_CAPS, BenchRequest, burst_requests

SYSTEMS = ("engine", "hf-static", "hf-naive")


def default_model_path() -> str:
    """The engine's default model folder (imported lazily from ``workers``)."""
    from workers.model_loader import default_model_path as _default

    return str(_default())


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``burst`` is the only runnable workload so far)."""
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    sub = parser.add_subparsers(dest="workload", required=True)
    burst = sub.add_parser("burst", help="256 requests x 128 prompt tokens, all at t=0")
    burst.add_argument("--cap", type=int, default=64, choices=BURST_CAPS, help="max output length")
    burst.add_argument("--systems", type=_csv, default=["engine", "hf-static"],
                       help=f"comma list of {', '.join(SYSTEMS)} (run in this order)")
    burst.add_argument("--static-batch-sizes", type=lambda v: [int(x) for x in _csv(v)],
                       default=[8, 16, 32, 64], help="comma list of hf-static batch sizes")
    burst.add_argument("--num-requests", type=int, default=None,
                       help="use only the first N requests (quick runs)")
    burst.add_argument("--model", default=None, help="HF model folder (default: engine default)")
    burst.add_argument("--dtype", default="bfloat16")
    burst.add_argument("--out", type=Path, default=Path("results"), help="output folder")
    over = sub.add_parser("overhead", help="engine in-process vs kvrelay serve over HTTP, same run")
    over.add_argument("--workloads", type=_csv, default=["burst", "poisson"], help="burst and/or poisson")
    over.add_argument("--cap", type=int, default=64, choices=BURST_CAPS, help="burst: max output length")
    over.add_argument("--qps", type=float, default=4.0, help="poisson: request rate")
    over.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    over.add_argument("--model", default=None, help="HF model folder (default: engine default)")
    over.add_argument("--dtype", default="bfloat16")
    over.add_argument("--out", type=Path, default=Path("results"), help="output folder")
    lp = sub.add_parser("long-prompt", help="long-prompt workload: colocated vs disaggregated kvrelay serve")
    lp.add_argument("--configs", type=_csv, default=None, help="subset of loadtest.long_prompt.CONFIGS labels")
    lp.add_argument("--transports", type=_csv, default=["object_store", "gloo"], help="for the transfer table")
    lp.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    lp.add_argument("--model", default=None, help="HF model folder (default: engine default)")
    lp.add_argument("--out", type=Path, default=Path("results"), help="output folder")
    args = parser.parse_args(argv)
    unknown = set(getattr(args, "systems", ())) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    return args


def run_overhead(args: argparse.Namespace, tokenizer: Any) -> int:
    """Each workload through the engine in-process, then through one `kvrelay serve`; print ratios."""
    from loadtest.overhead import LocalCluster, engine_side, server_side
    from loadtest.workloads import poisson_requests

    builders = {"burst": lambda: burst_requests(tokenizer, args.cap), "poisson": lambda: poisson_requests(tokenizer, args.qps)}
    workloads = {name: builders[name]()[: args.num_requests or None] for name in args.workloads}
    engine_options = {"model": args.model, "dtype": args.dtype}
    payload: dict[str, Any] = {"workload": "overhead", "parameters": {**vars(args), "out": str(args.out)},
                               "git_commit": git_commit(), "loadavg_start": loadavg(), "results": []}
    payload["parameters"]["workloads"] = list(workloads)
    out_path = args.out / f"overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
    rows = []
    for name, requests in workloads.items():
        print(f"engine in-process: {name}", file=sys.stderr)
        rows.append({"system": "engine", "workload": name, "stream": None, **engine_side(requests, engine_options)})
    with LocalCluster() as cluster:
        for name, requests in workloads.items():
            for stream in ((False, True) if name == "burst" else (True,)):
                print(f"kvrelay serve: {name} stream={stream}", file=sys.stderr)
                app = f"{name}-{'stream' if stream else 'plain'}"  # a fresh server: no prefix cache from a run before
                url = cluster.deploy(app, engine_options)
                rows.append({"system": "server", "workload": name, "stream": stream, **server_side(url, requests, stream)})
                cluster.delete(app)
    payload["results"] = rows
    payload["loadavg_end"] = loadavg()
    write_json(out_path, payload)
    print(format_overhead(rows))
    print(f"wrote {out_path}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def run_long_prompt(args: argparse.Namespace, tokenizer: Any) -> int:
    """`long-prompt` colocated (chunked off, budget 256, 512) and disaggregated, plus KV transfer MB/s."""
    from loadtest import long_prompt
    from loadtest.workloads import corpus_tokens

    payload: dict[str, Any] = {"workload": "long-prompt", "parameters": {**vars(args), "out": str(args.out)},
                               "git_commit": git_commit(), "loadavg_start": loadavg()}
    payload.update(long_prompt.run(tokenizer, corpus_tokens(tokenizer), args.transports, args.configs, args.num_requests))
    payload["loadavg_end"] = loadavg()
    out_path = args.out / f"long-prompt-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(out_path, payload)
    print(long_prompt.format_tables(payload))
    print(f"wrote {out_path}")
    return 0 if all(r["failed"] == 0 for r in payload["long_prompt"]) else 1


def format_overhead(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | system | stream | output tok/s | vs engine | TTFT p50 ms | TTFT p95 ms | ITL p95 ms | failed |",
             "|---|---|---|---|---|---|---|---|---|"]
    engine = {r["workload"]: r for r in rows if r["system"] == "engine"}
    for r in rows:
        base = engine[r["workload"]]
        ratio = r["output_throughput"] / base["output_throughput"] if base["output_throughput"] else 0.0
        stream = "" if r["stream"] is None else ("yes" if r["stream"] else "no")
        lines.append(f"| {r['workload']} | {r['system']} | {stream} | {r['output_throughput']:.1f} | {ratio:.3f} | "
                     f"{r['median_ttft_ms']:.1f} | {r['p95_ttft_ms']:.1f} | {r['p95_itl_ms']:.1f} | {r['failed']} |")
    return "\n".join(lines)


def run_system(name: str, args: argparse.Namespace, requests: list[BenchRequest],
               hf: dict[str, Any]) -> list[RunResult]:
    """Run one named system; the HF model is loaded once and cached in ``hf``."""
    if name == "engine":
        from loadtest.offline import load_engine, run_engine

        llm = load_engine(args.model, args.dtype)
        try:
            return [run_engine(llm, requests)]
        finally:
            del llm
            gc.collect()
    from loadtest.baselines import hf_naive, hf_static, load_hf_model, warmup_hf

    if "model" not in hf:
        hf["model"] = load_hf_model(args.model, args.dtype)
        warmup_hf(hf["model"])
    if name == "hf-naive":
        return [hf_naive(hf["model"], requests)]
    return [hf_static(hf["model"], requests, bs) for bs in args.static_batch_sizes]


def main(argv: list[str] | None = None) -> int:
    """Entry point: build the workload, run each system, report."""
    args = parse_args(argv)
    args.model = args.model or default_model_path()
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.workload == "overhead":
        return run_overhead(args, AutoTokenizer.from_pretrained(args.model))
    if args.workload == "long-prompt":
        return run_long_prompt(args, AutoTokenizer.from_pretrained(args.model))
    requests = burst_requests(AutoTokenizer.from_pretrained(args.model), args.cap)
    requests = requests[: args.num_requests] if args.num_requests else requests
    params = {
        "cap": args.cap, "num_requests": len(requests), "prompt_len": len(requests[0].prompt_token_ids),
        "output_lens_sum": sum(r.output_len for r in requests), "systems": args.systems,
        "static_batch_sizes": args.static_batch_sizes, "model": args.model, "dtype": args.dtype,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path = args.out / f"{args.workload}-cap{args.cap}-{stamp}.json"
    payload: dict[str, Any] = {
        "workload": args.workload, "parameters": params, "git_commit": git_commit(),
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                 "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "loadavg_start": loadavg(), "results": [],
    }
    print(f"burst cap={args.cap}: {len(requests)} requests, {params['output_lens_sum']} output tokens",
          file=sys.stderr)
    results: list[RunResult] = []
    hf: dict[str, Any] = {}
    failed = False
    for name in args.systems:
        try:
            done = run_system(name, args, requests, hf)
        except Exception as exc:  # keep the other systems' numbers; exit non-zero below
            traceback.print_exc()
            payload["results"].append({"system": name, "error": f"{type(exc).__name__}: {exc}"})
            done, failed = [], True
        for res in done:
            print(f"  {res.system}: {res.wall_s:.2f}s, {res.useful_tok_s:.1f} tok/s", file=sys.stderr)
            results.append(res)
            payload["results"].append(res.to_json())
        payload["loadavg_end"] = loadavg()
        write_json(out_path, payload)  # rewritten after each system so partial runs survive
    print(format_table(results))
    print(f"wrote {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
