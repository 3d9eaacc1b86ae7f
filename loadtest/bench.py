"""`kvrelay bench`: the benchmark workloads of docs/benchmarks.md against any OpenAI-compatible server,
our engine offline, the Hugging Face baselines, or all of them side by side in one run.

    kvrelay bench burst --url http://127.0.0.1:8000            # a running server
    kvrelay bench burst --offline --caps 16,64,256             # LLM.generate in this process
    kvrelay bench burst --baseline hf-static                   # HF generate, batches of 8/16/32/64
    kvrelay bench burst --systems hf-naive,hf-static,engine,server --caps 16,64,256 --plot
    kvrelay bench poisson --systems engine,server --qps 1,4,16 --plot
    kvrelay bench single --systems engine,server                 # one stream: 128-token prompt, 128 tokens
    kvrelay bench policies --qps 2 --plot                      # scheduling policies on poisson
    kvrelay bench random --url URL --input-len 256 --output-len 128 --request-rate 2 --burstiness 0.5
    kvrelay bench soak --concurrency 16                        # 10,000 mixed requests, a fresh server
    kvrelay bench compare results/a.json results/b.json
    kvrelay bench train-predictor                              # the `predicted` policy's length model
    kvrelay bench recovery --rounds 5                          # kill a replica, time until served again
    kvrelay bench structured --rounds 3                        # decode step time with grammar-constrained rows
    kvrelay bench decode-attention --batch 256 --context 200   # the decode kernel's K/V read rate vs memory
    kvrelay bench host-step --batch 256 --profile              # the engine's own Python per decode step

`server` starts a private local Ray cluster and deploys a fresh `kvrelay serve` app for every run (so
no run inherits another's prefix cache); `--url` measures whatever is listening there. Burst, poisson, single,
random and policies first measure this machine's ceilings (matmul rate at the model's shapes, memory
bandwidth) and report every result also as a fraction of its roofline; `--no-ceilings` skips that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from loadtest import decode_attention, host_step, long_prompt, recovery, result_commands, runners, single, structured
from loadtest.runners import LOCAL_SYSTEMS, TIMED_SYSTEMS
from loadtest.soak_mix import SoakMix
from loadtest.workloads import BURST_CAPS, SINGLE_LEN, SINGLE_NUM_REQUESTS
from workers.request_queue import SchedulingPolicy


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(value: str) -> list[int]:
    return [int(v) for v in _csv(value)]


def _floats(value: str) -> list[float]:
    return [float(v) for v in _csv(value)]


def _key_value(value: str) -> tuple[str, Any]:
    key, sep, raw = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        parsed = raw
    return key.strip().replace("-", "_"), parsed


def _add_target(p: argparse.ArgumentParser, systems: Sequence[str], baselines: bool) -> None:
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", help="base URL of a running OpenAI-compatible server")
    target.add_argument("--offline", action="store_true", help="our engine in this process (LLM API)")
    if baselines:
        target.add_argument("--baseline", choices=("hf-naive", "hf-static"), help="a Hugging Face baseline")
    target.add_argument("--systems", type=_csv, help=f"comma list of {', '.join(systems)}, run one after another "
                        "(server = a fresh `kvrelay serve` on a private local Ray cluster)")


def _add_common(p: argparse.ArgumentParser, stream_default: bool | None) -> None:
    p.add_argument("--model", default=None, help="model folder for local systems; served model name with --url "
                   "(default: the engine's default model / the server's first model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for building prompts (default: --model "
                   "when it is a folder, else the engine's default model)")
    p.add_argument("--dtype", default="auto", help="weights dtype of local systems (auto: the engine's choice for this "
                   "machine, see `kvrelay serve --help`)")
    p.add_argument("--engine-option", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine option for `engine` and `server` (repeatable), e.g. max_num_seqs=64")
    p.add_argument("--api-key", default=os.environ.get("KVRELAY_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for --url (default: $KVRELAY_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N requests of the workload")
    p.add_argument("--request-rate", type=float, default=None,
                   help="HTTP: replace the workload's arrival times by a seeded Poisson/gamma process (req/s; inf = all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of --request-rate gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="HTTP: most requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed of --request-rate arrivals")
    p.add_argument("--timeout", type=float, default=1800, help="HTTP: seconds before one request counts as failed")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's sampling temperature (default 0: greedy, as in `vllm bench serve`)")
    p.add_argument("--top-p", type=float, default=None, help="every request's top_p (needs --temperature > 0)")
    p.add_argument("--top-k", type=int, default=None, help="every request's top_k (needs --temperature > 0)")
    if stream_default is not None:
        p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=stream_default,
                       help=f"HTTP: stream responses (default: {'on' if stream_default else 'off'})")
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON (and PNG) results")
    p.add_argument("--plot", action="store_true", help="write PNG plots next to the JSON")
    p.add_argument("--no-ceilings", dest="ceilings", action="store_false",
                   help="skip measuring this machine's ceilings (matmul rate, memory bandwidth; a few seconds) and "
                        "the results' fractions of their rooflines")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def build_parser(prog: str = "kvrelay bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="workload", required=True)

    p = sub.add_parser("burst", help="256 requests x 128 prompt tokens at t=0; throughput per output-length cap")
    _add_target(p, LOCAL_SYSTEMS, baselines=True)
    p.add_argument("--caps", "--cap", type=_ints, default=[64], help=f"comma list of output caps from {BURST_CAPS}")
    p.add_argument("--batch-sizes", "--static-batch-sizes", type=_ints, default=[8, 16, 32, 64], help="HF static batch sizes")
    _add_common(p, stream_default=False)

    p = sub.add_parser("poisson", help="100 requests, Poisson arrivals; latency at each QPS")
    _add_target(p, TIMED_SYSTEMS, baselines=False)
    p.add_argument("--qps", type=_floats, default=[1.0, 4.0, 16.0], help="comma list of request rates")
    _add_common(p, stream_default=True)

    p = sub.add_parser("single", help="one stream at a time: a 128-token prompt, then 128 tokens; TTFT and decode "
                       "tok/s against the memory-bandwidth roofline")
    _add_target(p, TIMED_SYSTEMS, baselines=False)
    p.add_argument("--input-len", type=int, default=SINGLE_LEN, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=SINGLE_LEN, help="output tokens")
    _add_common(p, stream_default=True)
    p.set_defaults(num_requests=SINGLE_NUM_REQUESTS)

    p = sub.add_parser("random", help="random prompt/output lengths around --input-len/--output-len")
    _add_target(p, TIMED_SYSTEMS, baselines=False)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the random lengths")
    _add_common(p, stream_default=True)
    p.set_defaults(num_requests=None)

    p = sub.add_parser("long-prompt", help="200 requests at 4 QPS, 10%% with 2,048-token prompts")
    p.add_argument("--url", help="measure a running server; without it, run the colocated/disaggregated suite")
    p.add_argument("--configs", type=_csv, default=None, help="suite: subset of loadtest.long_prompt.CONFIGS labels")
    p.add_argument("--transports", type=_csv, default=["object_store", "gloo"], help="suite: KV transfer table")
    _add_common(p, stream_default=True)

    p = sub.add_parser("policies", help=f"{' / '.join(runners.POLICIES)} scheduling on poisson, one fresh server each")
    p.add_argument("--qps", type=float, default=2.0, help="request rate (the highest one the server sustains)")
    p.add_argument("--policies", type=_csv, default=list(runners.POLICIES),
                   help=f"comma list of scheduling policies from {', '.join(SchedulingPolicy.names())} "
                        f"(default: {','.join(runners.POLICIES)})")
    p.add_argument("--length-predictor", default=None,
                   help=f"predictor JSON for `{SchedulingPolicy.PREDICTED.value}` "
                        "(default: the trained one in loadtest/data)")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the policies (interleaved)")
    _add_common(p, stream_default=True)

    p = sub.add_parser("train-predictor",
                       help=f"fit the `{SchedulingPolicy.PREDICTED.value}` policy's output-length model")
    p.add_argument("--num-prompts", type=int, default=400, help="poisson-style prompts (the first 100 are held out)")
    p.add_argument("--lengths", type=Path, default=None, help="reuse lengths collected before (JSON) instead of generating")
    p.add_argument("--output", type=Path, default=None, help="predictor JSON (default: loadtest/data/length_predictor.json)")
    p.add_argument("--model", default=None, help="model folder (default: the engine's default model)")
    p.add_argument("--dtype", default="auto")

    p = sub.add_parser("overhead", help="engine in-process vs `kvrelay serve` on burst and poisson, same run")
    p.add_argument("--workloads", type=_csv, default=["burst", "poisson"], help="burst and/or poisson")
    p.add_argument("--cap", type=int, default=64, choices=BURST_CAPS, help="burst: max output length")
    p.add_argument("--qps", type=float, default=4.0, help="poisson: request rate")
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    p.add_argument("--model", default=None, help="HF model folder (default: engine default)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, default=Path("results"), help="output folder")

    p = sub.add_parser("soak", help="10,000 small mixed requests at a fixed concurrency; nothing lost, nothing left "
                       "behind, no memory growth")
    p.add_argument("--url", help="base URL of a running server (default: a fresh `kvrelay serve` on a private local "
                   "Ray cluster)")
    p.add_argument("--model", default=None, help="model folder for the local server; served model name with --url "
                   "(default: the engine's default model / the server's first model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for building prompts (default: --model when it "
                   "is a folder, else the engine's default model)")
    p.add_argument("--dtype", default="auto", help="weights dtype of the local server")
    p.add_argument("--engine-option", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine option for the local server (repeatable), e.g. max_num_seqs=64")
    p.add_argument("--api-key", default=os.environ.get("KVRELAY_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for --url (default: $KVRELAY_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--num-requests", type=int, default=10_000, help="measured requests (default: 10000, about 20 "
                   "minutes on 2 cores with the default model)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    p.add_argument("--warmup", type=int, default=500, help="untimed requests of the same mix first; the replica's "
                   "memory after them is the baseline (default: 500; the replica's RSS grows over the first few "
                   "hundred requests, then settles)")
    p.add_argument("--max-prompt-len", type=int, default=SoakMix.max_prompt_len,
                   help=f"prompts are {SoakMix.min_prompt_len}..N tokens (default: {SoakMix.max_prompt_len})")
    p.add_argument("--max-tokens", type=int, default=SoakMix.max_max_tokens,
                   help=f"max_tokens is {SoakMix.min_max_tokens}..N (default: {SoakMix.max_max_tokens})")
    p.add_argument("--disconnect-fraction", type=float, default=SoakMix.disconnect_share,
                   help=f"share of requests the client closes mid-stream (default: {SoakMix.disconnect_share})")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds without a whole answer before a request counts as lost (default: 120)")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds to wait for the engine to go idle after the last answer (default: 60)")
    p.add_argument("--max-rss-growth", type=float, default=10.0,
                   help="percent the engine replica's RSS may grow from the warmed-up baseline (default: 10)")
    p.add_argument("--rss-interval", type=float, default=10.0, help="seconds between RSS samples (default: 10)")
    p.add_argument("--serve-app", default=None, help="with --url: the Serve app whose engine replicas to watch "
                   "(default: the URL's first path segment, else the only app on this host)")
    p.add_argument("--replica-pid", type=int, action="append", default=[], metavar="PID",
                   help="with --url: watch these engine replica processes instead (repeatable)")
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON result")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    p = sub.add_parser("compare", help="print result files side by side, with ratios")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--baseline", default=None, help="system or family to take ratios against (default: first run)")

    p = sub.add_parser("plot", help="(re)draw the PNG plots of result files")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--together", type=Path, default=None, metavar="STEM",
                   help="draw the runs of all the files (one workload) in one plot, written as STEM-*.png")
    p.add_argument("--labels", default=None, help="with --together: a comma-separated name per file for its runs")

    recovery.add_parser(sub, _key_value)
    structured.add_parser(sub)
    decode_attention.add_parser(sub)
    host_step.add_parser(sub)
    return parser


def _validate(args: argparse.Namespace) -> None:
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    runners.sampling_options(args)  # before a tokenizer or a model loads


RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "recovery": recovery.run_recovery, "structured": structured.run_structured,
    "decode-attention": decode_attention.run_decode_attention, "host-step": host_step.run_host_step,
    "burst": runners.run_burst, "poisson": runners.run_poisson, "random": runners.run_random,
    "single": single.run_single,
    "long-prompt": long_prompt.run_long_prompt, "policies": runners.run_policies,
    "train-predictor": result_commands.run_train_predictor, "overhead": runners.run_overhead,
    "compare": result_commands.run_compare, "plot": result_commands.run_plot, "soak": runners.run_soak,
}


def main(argv: Sequence[str] | None = None, prog: str = "kvrelay bench") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(prog).parse_args(argv)
    args.argv = argv
    if hasattr(args, "request_rate"):
        try:
            _validate(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.workload not in ("compare", "plot"):
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        return RUNNERS[args.workload](args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
