"""`kvrelay bench single`: one stream at a time, a 128-token prompt then 128 tokens: the latency an interactive
user feels at low load (TTFT and decode tok/s), through the engine in-process, a fresh `kvrelay serve` or a
server at --url, judged against the memory-bandwidth roofline (weights + KV bytes read per token)."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any, Sequence

from loadtest import report, runners
from loadtest.roofline import lengths_of_results
from loadtest.workloads import BenchRequest, single_requests, with_sampling


def run_single(args: argparse.Namespace) -> int:
    from loadtest.metrics import summarize

    systems = runners._systems(args, runners.TIMED_SYSTEMS)
    requests = single_requests(runners._load_tokenizer(args), args.num_requests, args.input_len, args.output_len)
    args.max_concurrency, args.request_rate = 1, None  # HTTP: the next request leaves when the last one ends
    params = {"num_requests": len(requests), "input_len": args.input_len, "output_len": args.output_len,
              "systems": systems, "stream": args.stream, "model": args.model, "dtype": args.dtype, "url": args.url,
              "engine_options": dict(args.engine_option)}
    payload, path, res = runners._begin(args, "single", params)
    try:
        for system, _ in runners._run_order(systems, [None]):
            print(f"single ({len(requests)} x {args.input_len} + {args.output_len} tokens, one at a time): {system} ...",
                  file=sys.stderr)

            def one(s: str = system) -> list[dict[str, Any]]:
                results, duration = _one_at_a_time(s, requests, args, res)
                run = report.run_from_results(args.url if s == "url" else s, s, "single", summarize(results, duration),
                                              results, extra={"stream": args.stream})
                return [res.annotate(run, lengths_of_results(results))]

            runners._guarded(payload, path, system, one)
    finally:
        res.close()
    return runners._finish(payload, path, args, [report.single_table(payload["runs"])])


def _one_at_a_time(system: str, requests: Sequence[BenchRequest], args: argparse.Namespace,
                   res: runners.Systems) -> tuple[list[Any], float]:
    if system == "engine":
        requests = with_sampling(list(requests), runners.sampling_options(args))
        return engine_one_at_a_time(requests, runners._engine_options(args))
    return runners.timed_run(system, requests, args, res, args.stream)


def engine_one_at_a_time(requests: Sequence[BenchRequest], engine_options: dict[str, Any]) -> tuple[list[Any], float]:
    """A fresh engine, one untimed warm-up request, then each request alone; the duration is their sum."""
    from loadtest.overhead import run_engine_inprocess
    from serving import LLM

    llm = LLM(**engine_options)
    try:
        run_engine_inprocess(llm, [BenchRequest(requests[0].prompt_token_ids[:8], 2)])
        results, total = [], 0.0
        for request in requests:
            done, seconds = run_engine_inprocess(llm, [request])
            results += done
            total += seconds
        return results, total
    finally:
        del llm
        gc.collect()
