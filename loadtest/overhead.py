"""What the HTTP path costs: one workload through the engine in-process and through `kvrelay serve`
(Ray Serve, real HTTP on 127.0.0.1), one after the other in the same run, with the same engine options.

`python -m loadtest overhead --out docs/results` runs `burst` (cap 64) and `poisson` (QPS 4).

The in-process side drives the engine the way `LLM.generate` does (add requests, step until done),
adding each request when its arrival time comes and timestamping every step, so TTFT and ITL are
measured on both sides the same way: from the request's scheduled arrival to the step (or SSE event)
that delivered its tokens."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from loadtest.http_client import RequestResult, run_load
from loadtest.metrics import summarize
from loadtest.results import git_commit, loadavg, write_json
from loadtest.workloads import BenchRequest, burst_requests

MODEL_NAME = "kvrelay-bench"


def run_engine_inprocess(llm: Any, requests: Sequence[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Feed `requests` to the engine at their arrival times; per-request token timings from each step."""
    from workers.output_processor import OutputKind
    from workers.sampling_params import SamplingParams

    engine = llm.engine
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    results = [RequestResult(success=False, prompt_tokens=len(r.prompt_token_ids), expected_output_tokens=r.output_len)
               for r in requests]
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(order) and requests[order[nxt]].arrival_time <= now:
            i = order[nxt]
            r = requests[i]
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, **r.sampling_options())
            engine.add_request(str(i), None, params, prompt_token_ids=list(r.prompt_token_ids),
                               output_kind=OutputKind.DELTA)
            results[i].start_time = t0 + r.arrival_time
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[order[nxt]].arrival_time - (time.perf_counter() - t0)))
            continue
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            res = results[int(out.request_id)]
            n = len(out.outputs[0].token_ids)
            if n:
                res.record_arrival(t - res.start_time)
                res.output_tokens += n
            if out.finished:
                res.latency = t - res.start_time
                res.success = res.output_tokens == res.expected_output_tokens
                if not res.success:
                    res.error = f"generated {res.output_tokens} tokens, expected {res.expected_output_tokens}"
    return results, time.perf_counter() - t0


def engine_results(requests: Sequence[BenchRequest], engine_options: dict) -> tuple[list[RequestResult], float]:
    """A fresh engine (no prefix cache from before), one untimed warm-up request, then `requests`."""
    from serving import LLM

    llm = LLM(**engine_options)
    try:
        run_engine_inprocess(llm, [BenchRequest(requests[0].prompt_token_ids[:8], 2)])  # warm-up
        return run_engine_inprocess(llm, requests)
    finally:
        del llm
        gc.collect()


def engine_side(requests: Sequence[BenchRequest], engine_options: dict) -> dict:
    return summarize(*engine_results(requests, engine_options))


class LocalCluster:
    """A private local Ray cluster with Serve on a free port; `deploy` runs `kvrelay serve`'s app. With
    `direct_ingress`, as `kvrelay serve` runs by default: the app's ingress replica answers HTTP on that port
    itself (Serve's direct ingress; `serving/direct_ingress.py`) and Serve's proxy sits on a spare one, so
    one app at a time, each with the engine in its one replica."""

    def __init__(self, direct_ingress: bool = False) -> None:
        self.direct_ingress = direct_ingress

    def __enter__(self) -> LocalCluster:
        import socket

        from serving import direct_ingress
        from serving.ray_cluster import free_port, init_ray

        os.environ.pop("RAY_ADDRESS", None)
        with socket.socket() as held:  # the app's port, held while the proxy's is picked, so they differ
            held.bind(("127.0.0.1", 0))
            port, proxy_port = held.getsockname()[1], free_port()
        direct = self.direct_ingress and direct_ingress.can_bind_reusing_address()
        self._env = direct_ingress.env(port) if direct else {}
        self._saved_env = {k: os.environ.get(k) for k in self._env}
        os.environ.update(self._env)  # read by Serve's processes as Ray starts them
        self.temp_dir = init_ray()
        from ray import serve

        serve.start(http_options={"host": "127.0.0.1", "port": proxy_port if direct else port})
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def deploy(self, name: str, options: dict) -> str:
        from serving.app_config import parse_app_args
        from serving.ray_cluster import deploy_app

        options = {**options, "served_model_name": MODEL_NAME}
        if self._env and not parse_app_args(options).engine_runs_in_ingress:
            raise ValueError("a direct-ingress cluster serves apps with the engine in the ingress's one replica")
        return deploy_app(name, options, self.base_url)

    def delete(self, name: str) -> None:
        from ray import serve

        serve.delete(name)

    def __exit__(self, *exc) -> None:
        from ray import serve

        from serving.ray_cluster import stop_ray

        serve.shutdown()
        stop_ray(self.temp_dir)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def server_results(url: str, model: str, requests: Sequence[BenchRequest], stream: bool,
                   **load_options: Any) -> tuple[list[RequestResult], float]:
    """One untimed warm-up request, then `requests` through the HTTP load generator."""
    warm = [BenchRequest(requests[0].prompt_token_ids[:8], 2)]
    asyncio.run(run_load(url, model, warm, stream=stream, api_key=load_options.get("api_key"), progress=False))
    return asyncio.run(run_load(url, model, list(requests), stream=stream, **load_options))


def server_side(url: str, requests: Sequence[BenchRequest], stream: bool) -> dict:
    return summarize(*server_results(url, MODEL_NAME, requests, stream, progress=False))


def run_overhead(args: argparse.Namespace, tokenizer: Any) -> int:
    """Each workload through the engine in-process, then through one `kvrelay serve`; print ratios."""
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
    with LocalCluster(direct_ingress=True) as cluster:  # as `kvrelay serve` runs by default
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
