"""What the HTTP path costs: one workload through the engine in-process and through `kvrelay serve`
(Ray Serve, real HTTP on 127.0.0.1), one after the other in the same run, with the same engine options.

`python -m loadtest overhead --out docs/results` runs `burst` (cap 64) and `poisson` (QPS 4).

The in-process side drives the engine the way `LLM.generate` does (add requests, step until done),
adding each request when its arrival time comes and timestamping every step, so TTFT and ITL are
measured on both sides the same way: from the request's scheduled arrival to the step (or SSE event)
that delivered its tokens."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Sequence
from typing import Any

from loadtest.http_client import RequestResult, run_load
from loadtest.metrics import summarize
from loadtest.workloads import BenchRequest

MODEL_NAME = "kvrelay-bench"


def run_engine_inprocess(llm: Any, requests: Sequence[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Feed `requests` to the engine at their arrival times; per-request token timings from each step."""
    from workers.engine import OutputKind
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
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
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


def engine_side(requests: Sequence[BenchRequest], engine_options: dict) -> dict:
    from serving import LLM

    llm = LLM(**engine_options)
    run_engine_inprocess(llm, [BenchRequest(requests[0].prompt_token_ids[:8], 2)])  # warm-up
    results, duration = run_engine_inprocess(llm, requests)
    del llm
    gc.collect()
    return summarize(results, duration)


class LocalCluster:
    """A private local Ray cluster with Serve on a free port; `deploy` runs `kvrelay serve`'s app."""

    def __enter__(self) -> LocalCluster:
        from serving.ray_cluster import free_port, init_ray

        os.environ.pop("RAY_ADDRESS", None)
        init_ray()
        from ray import serve

        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def deploy(self, name: str, options: dict) -> str:
        from serving.ray_cluster import deploy_app

        return deploy_app(name, {**options, "served_model_name": MODEL_NAME}, self.base_url)

    def delete(self, name: str) -> None:
        from ray import serve

        serve.delete(name)

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def server_side(url: str, requests: Sequence[BenchRequest], stream: bool) -> dict:
    asyncio.run(run_load(url, MODEL_NAME, [BenchRequest(requests[0].prompt_token_ids[:8], 2)], stream=stream,
                         progress=False))  # warm-up
    results, duration = asyncio.run(run_load(url, MODEL_NAME, list(requests), stream=stream, progress=False))
    return summarize(results, duration)
