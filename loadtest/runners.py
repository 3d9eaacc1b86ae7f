"""The systems and workload runners behind `kvrelay bench` (the command line is in loadtest/bench.py):
HF baselines, our engine in-process, a fresh `kvrelay serve` on a private Ray cluster, or a server at a
URL; each runner writes one result JSON (loadtest/report.py) and optionally its plots."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

from loadtest import report, workloads
from loadtest.roofline import RunRooflines, lengths_of_requests, lengths_of_results
from loadtest.workloads import BURST_CAPS, BenchRequest
from workers.request_queue import SchedulingPolicy


LOCAL_SYSTEMS = ("hf-naive", "hf-static", "engine", "server")
TIMED_SYSTEMS = ("engine", "server")  # systems with per-token timings (poisson, random, policies)
# `priority` sits out by default: the poisson workload gives every request the same priority, so it repeats fcfs.
POLICIES = tuple(p.value for p in SchedulingPolicy if p is not SchedulingPolicy.PRIORITY)


# -- helpers ---------------------------------------------------------------------------------------------

def default_model_path() -> str:
    from workers.model_loader import default_model_path as _default

    return str(_default())


def served_model(url: str, api_key: str | None) -> str:
    """The first model id of ``GET {url}/v1/models``."""
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    req = urllib.request.Request(base + "/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            models = json.loads(resp.read())["data"]
    except Exception as exc:
        raise ValueError(f"could not list models at {base}/models ({exc}); pass --model") from None
    if not models:
        raise ValueError(f"{base}/models lists no model; pass --model")
    return str(models[0]["id"])


def _is_folder(path: str | None) -> bool:
    return bool(path) and Path(path).is_dir()


def _load_tokenizer(args: argparse.Namespace) -> Any:
    from transformers import AutoTokenizer

    path = args.tokenizer or (args.model if _is_folder(args.model) else None) or default_model_path()
    return AutoTokenizer.from_pretrained(path)


def _systems(args: argparse.Namespace, allowed: Sequence[str]) -> list[str]:
    if getattr(args, "url", None):
        return ["url"]
    if getattr(args, "offline", False):
        return ["engine"]
    if getattr(args, "baseline", None):
        return [args.baseline]
    if not getattr(args, "systems", None):
        raise ValueError("choose what to measure: --url URL, --offline"
                         + (", --baseline NAME" if "hf-naive" in allowed else "") + " or --systems LIST")
    unknown = [s for s in args.systems if s not in allowed]
    if unknown:
        raise ValueError(f"unknown systems for {args.workload}: {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return list(args.systems)


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Options for `engine` and `server`: the model folder (when given), dtype and --engine-option."""
    options = {"dtype": args.dtype, **dict(args.engine_option)}
    if args.model and not getattr(args, "url", None):
        options["model"] = args.model
    return options


class Systems:
    """Lazily built, reused resources of one bench run: the HF model and the local Ray cluster."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.hf_model: Any = None
        self.cluster: Any = None
        self.model_name: str | None = None
        self.apps = 0
        self.rooflines: RunRooflines | None = None  # once the ceilings are measured

    def annotate(self, run: dict[str, Any], lengths: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """Add the run's rooflines (its fractions of this machine's ceilings), unless --no-ceilings."""
        return self.rooflines.annotate(run, lengths) if self.rooflines else run

    def hf(self) -> Any:
        if self.hf_model is None:
            from loadtest.baselines import load_hf_model, warmup_hf

            self.hf_model = load_hf_model(self.args.model or default_model_path(), self.args.dtype)
            warmup_hf(self.hf_model)
        return self.hf_model

    def deploy(self, options: dict[str, Any]) -> tuple[str, str]:
        """A fresh `kvrelay serve` app on the private cluster, with `kvrelay serve`'s default direct ingress:
        (url, app name)."""
        from loadtest.overhead import LocalCluster

        if self.cluster is None:
            self.cluster = LocalCluster(direct_ingress=True).__enter__()
        self.apps += 1
        name = f"bench{self.apps}"
        return self.cluster.deploy(name, options), name

    def url_model(self) -> str:
        if self.model_name is None:
            self.model_name = self.args.model or served_model(self.args.url, self.args.api_key)
        return self.model_name

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.__exit__(None, None, None)
            self.cluster = None
        self.hf_model = None
        gc.collect()


def http_run(url: str, model: str, requests: Sequence[BenchRequest], args: argparse.Namespace,
             stream: bool) -> tuple[list[Any], float]:
    """One untimed warm-up request, then the workload with the command line's HTTP options."""
    from loadtest.overhead import server_results

    return server_results(url, model, requests, stream, api_key=args.api_key, max_concurrency=args.max_concurrency,
                          request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed,
                          timeout_s=args.timeout, progress=args.progress)


def timed_run(system: str, requests: Sequence[BenchRequest], args: argparse.Namespace, res: Systems,
              stream: bool, options: dict[str, Any] | None = None) -> tuple[list[Any], float]:
    """Per-token-timed run on `engine` (in-process, arrival times honoured), `server` or `url`."""
    from loadtest.overhead import MODEL_NAME, engine_results

    options = options or _engine_options(args)
    requests = workloads.with_sampling(list(requests), sampling_options(args))
    if system == "engine":
        return engine_results(requests, options)
    if system == "server":
        url, app = res.deploy(options)
        try:
            return http_run(url, MODEL_NAME, requests, args, stream)
        finally:
            res.cluster.delete(app)
    return http_run(args.url, res.url_model(), requests, args, stream)


def _finish(payload: dict[str, Any], path: Path, args: argparse.Namespace, tables: list[str]) -> int:
    report.write_payload(path, payload)
    for table in tables + report.roofline_tables(payload):
        print(table + "\n")
    if getattr(args, "plot", False):
        from loadtest.plots import plot_payload

        for png in plot_payload(payload, path):
            print(f"wrote {png}")
    print(f"wrote {path}")
    failed = any(r["metrics"].get("failed") for r in payload["runs"]) or bool(payload.get("errors"))
    return 1 if failed else 0


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _run_order(systems: Sequence[str], params: Sequence[Any]) -> list[tuple[str, Any]]:
    """(system, cap or QPS) pairs: in-process systems first, for every parameter, then `server` for every
    parameter, so the local Ray cluster (started by the first server run) never idles beside the others."""
    pairs = [(s, p) for p in params for s in systems if s != "server"]
    return pairs + [("server", p) for p in params if "server" in systems]


def sampling_options(args: argparse.Namespace) -> dict[str, float]:
    """The requests' sampling options from --temperature, --top-p and --top-k (OpenAI names; empty: greedy)."""
    temperature = getattr(args, "temperature", 0.0) or 0.0
    top_p, top_k = getattr(args, "top_p", None), getattr(args, "top_k", None)
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise ValueError(f"--top-k must be -1 (off) or >= 1, got {top_k}")
    if not temperature:
        if top_p is not None or top_k is not None:
            raise ValueError("--top-p and --top-k need --temperature > 0 (at 0 the requests are greedy)")
        return {}
    options: dict[str, float] = {"temperature": temperature}
    if top_p is not None:
        options["top_p"] = top_p
    if top_k is not None:
        options["top_k"] = top_k
    return options


def _begin(args: argparse.Namespace, workload: str, params: dict[str, Any]) -> tuple[dict[str, Any], Path, Systems]:
    """A new result payload with this machine's ceilings, the path it will be written to, and the run's lazily
    built systems."""
    params = {**params, "sampling": sampling_options(args)}
    payload, res = report.new_payload(workload, params, args.argv), Systems(args)
    path = args.out / f"{workload}-{_stamp()}.json"
    if getattr(args, "ceilings", True):
        res.rooflines = measure_rooflines(args, payload)
        report.write_payload(path, payload)  # an interrupted run keeps them
    return payload, path, res


def measure_rooflines(args: argparse.Namespace, payload: dict[str, Any]) -> RunRooflines:
    """Measure the ceilings with the engine's thread count, dtype and device, at the shapes of the run's model
    (the --model folder, else the --tokenizer folder, else the default model), into ``payload["ceilings"]``."""
    import torch

    from loadtest.ceilings import measure_ceilings
    from loadtest.model_shape import ModelShape
    from workers.model_loader import dtype_name, resolve_dtype

    folder = next((f for f in (args.model, args.tokenizer) if _is_folder(f)), None) or default_model_path()
    shape = ModelShape.from_folder(folder)
    options = dict(args.engine_option)
    device = str(options.get("device", "auto"))
    device = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    dtype = dtype_name(resolve_dtype(args.dtype, device))  # the engine's `auto` on this machine
    print(f"measuring this machine's ceilings at {Path(folder).name}'s shapes (--no-ceilings skips) ...", file=sys.stderr)
    ceilings = measure_ceilings(shape, threads=options.get("num_threads") or os.cpu_count(), dtype=dtype, device=device)
    payload.update(ceilings=ceilings.to_json(), model_shape={**dataclasses.asdict(shape), "folder": str(folder)})
    return RunRooflines(shape, ceilings)


def _guarded(payload: dict[str, Any], path: Path, system: str, fn: Callable[[], list[dict[str, Any]]]) -> None:
    """Run one system; keep the others' numbers if it fails, and rewrite the JSON after each."""
    try:
        payload["runs"] += fn()
    except Exception as exc:  # reported in the JSON and the exit status
        traceback.print_exc()
        payload.setdefault("errors", []).append({"system": system, "error": f"{type(exc).__name__}: {exc}"})
    report.write_payload(path, payload)


# -- workloads -----------------------------------------------------------------------------------------

def run_burst(args: argparse.Namespace) -> int:
    from loadtest.workloads import burst_requests

    bad = [c for c in args.caps if c not in BURST_CAPS]
    if bad:
        raise ValueError(f"burst caps must be among {BURST_CAPS}, got {bad}")
    systems = _systems(args, LOCAL_SYSTEMS)
    greedy_only = [s for s in systems if s in ("hf-naive", "hf-static")]
    if sampling_options(args) and greedy_only:
        raise ValueError(f"{', '.join(greedy_only)} decode greedily; run them without --temperature")
    tokenizer = _load_tokenizer(args)
    params = {"caps": args.caps, "systems": systems, "batch_sizes": args.batch_sizes, "num_requests": args.num_requests,
              "stream": args.stream, "model": args.model, "dtype": args.dtype, "url": args.url,
              "engine_options": dict(args.engine_option), "request_rate": args.request_rate,
              "max_concurrency": args.max_concurrency}
    payload, path, res = _begin(args, "burst", params)
    try:
        workloads = {cap: burst_requests(tokenizer, cap)[: args.num_requests or None] for cap in args.caps}
        for system, cap in _run_order(systems, args.caps):
            requests = workloads[cap]
            print(f"burst cap {cap} ({len(requests)} requests, {sum(r.output_len for r in requests)} output tokens): "
                  f"{system} ...", file=sys.stderr)
            prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
            _guarded(payload, path, system,
                     lambda s=system, c=cap, reqs=requests, n=prompt_tokens: _burst_system(s, c, reqs, n, args, res))
    finally:
        res.close()
    return _finish(payload, path, args, [report.burst_table(payload["runs"]), report.static_table(payload["runs"])])


def _burst_system(system: str, cap: int, requests: list[BenchRequest], prompt_tokens: int,
                  args: argparse.Namespace, res: Systems) -> list[dict[str, Any]]:
    from loadtest.metrics import summarize

    if system == "hf-naive":
        from loadtest.baselines import hf_naive

        return [res.annotate(report.run_from_offline(hf_naive(res.hf(), requests, progress=args.progress), "hf-naive",
                                                     "burst", prompt_tokens, cap), lengths_of_requests(requests))]
    if system == "hf-static":
        from loadtest.baselines import hf_static

        return [res.annotate(report.run_from_offline(hf_static(res.hf(), requests, bs, progress=args.progress),
                                                     "hf-static", "burst", prompt_tokens, cap),
                             lengths_of_requests(requests)) for bs in args.batch_sizes]
    if system == "engine":
        from loadtest.offline import run_engine
        from serving import LLM

        llm = LLM(**_engine_options(args))  # fresh per cap
        requests = workloads.with_sampling(requests, sampling_options(args))
        try:
            return [res.annotate(report.run_from_offline(run_engine(llm, requests, progress=args.progress), "engine",
                                                         "burst", prompt_tokens, cap), lengths_of_requests(requests))]
        finally:
            del llm
            gc.collect()
    results, duration = timed_run(system, requests, args, res, args.stream)
    name = "server" if system == "server" else args.url
    return [res.annotate(report.run_from_results(name, system, "burst", summarize(results, duration), results, cap=cap,
                                                 extra={"stream": args.stream}), lengths_of_results(results))]


def run_poisson(args: argparse.Namespace) -> int:
    from loadtest.metrics import summarize
    from loadtest.workloads import poisson_requests

    systems = _systems(args, TIMED_SYSTEMS)
    tokenizer = _load_tokenizer(args)
    params = {"qps": args.qps, "systems": systems, "num_requests": args.num_requests, "stream": args.stream,
              "model": args.model, "dtype": args.dtype, "url": args.url, "engine_options": dict(args.engine_option)}
    payload, path, res = _begin(args, "poisson", params)
    try:
        workloads = {qps: poisson_requests(tokenizer, qps)[: args.num_requests or None] for qps in args.qps}
        for system, qps in _run_order(systems, args.qps):
            print(f"poisson QPS {qps:g}: {system} ...", file=sys.stderr)

            def one(s: str = system, q: float = qps) -> list[dict[str, Any]]:
                results, duration = timed_run(s, workloads[q], args, res, args.stream)
                name = args.url if s == "url" else s
                return [res.annotate(report.run_from_results(name, s, "poisson", summarize(results, duration), results,
                                                             qps=q, extra=_offered(workloads[q])),
                                     lengths_of_results(results))]

            _guarded(payload, path, system, one)
    finally:
        res.close()
    return _finish(payload, path, args, [report.latency_table(payload["runs"])])


def _offered(requests: Sequence[BenchRequest]) -> dict[str, float]:
    """The offered load: output tokens per second of the arrival process."""
    span = max(r.arrival_time for r in requests) or 1.0
    return {"offered_output_tok_s": sum(r.output_len for r in requests) / span}


def run_random(args: argparse.Namespace) -> int:
    from loadtest.metrics import format_summary, summarize

    systems = _systems(args, TIMED_SYSTEMS)
    requests = workloads.random_requests(_load_tokenizer(args), args.num_requests or 100, args.input_len, args.output_len,
                               args.range_ratio, args.dataset_seed)
    if args.request_rate is not None:  # give the in-process engine the same arrivals as HTTP
        from loadtest.http_client import arrival_schedule

        times = arrival_schedule(len(requests), args.request_rate, args.burstiness, args.seed)
        requests = [BenchRequest(r.prompt_token_ids, r.output_len, t) for r, t in zip(requests, times)]
    params = {k: getattr(args, k) for k in ("input_len", "output_len", "range_ratio", "dataset_seed", "request_rate",
                                             "burstiness", "max_concurrency", "stream", "url", "model")}
    params.update(num_requests=len(requests), systems=systems)
    payload, path, res = _begin(args, "random", params)
    summaries = []
    try:
        for system in systems:
            def one(s: str = system) -> list[dict[str, Any]]:
                results, duration = timed_run(s, requests, args, res, args.stream)
                summary = summarize(results, duration)
                summaries.append(f"{s}\n{format_summary(summary)}")
                return [res.annotate(report.run_from_results(args.url if s == "url" else s, s, "random", summary,
                                                             results, qps=args.request_rate),
                                     lengths_of_results(results))]

            _guarded(payload, path, system, one)
    finally:
        res.close()
    return _finish(payload, path, args, summaries)


def run_policies(args: argparse.Namespace) -> int:
    from loadtest.metrics import summarize
    from loadtest.predictor import DEFAULT_PREDICTOR
    from loadtest.workloads import poisson_requests

    unknown = [p for p in args.policies if p not in SchedulingPolicy.names()]
    if unknown:
        raise ValueError(f"unknown policies: {', '.join(unknown)}; choose from {', '.join(SchedulingPolicy.names())}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    predictor = Path(args.length_predictor or DEFAULT_PREDICTOR).resolve()
    if SchedulingPolicy.PREDICTED.value in args.policies and not predictor.is_file():
        raise ValueError(f"no length predictor at {predictor}; run `kvrelay bench train-predictor` first")
    requests = poisson_requests(_load_tokenizer(args), args.qps)[: args.num_requests or None]
    params = {"qps": args.qps, "policies": args.policies, "repeats": args.repeats, "length_predictor": str(predictor),
              "num_requests": len(requests), "stream": args.stream, "model": args.model, "dtype": args.dtype,
              "engine_options": dict(args.engine_option)}
    payload, path, res = _begin(args, "policies", params)
    try:
        for round_ in range(args.repeats):
            for policy in args.policies:
                print(f"policies QPS {args.qps:g}: {policy} (round {round_ + 1})", file=sys.stderr)
                options = {**_engine_options(args), "scheduling_policy": policy}
                if policy == SchedulingPolicy.PREDICTED.value:
                    options["length_predictor"] = str(predictor)

                def one(p: str = policy, o: dict = options, r: int = round_) -> list[dict[str, Any]]:
                    results, duration = timed_run("server", requests, args, res, args.stream, o)
                    run = report.run_from_results("server", "server", "poisson", summarize(results, duration), results,
                                                  qps=args.qps, extra={"round": r, **_offered(requests)})
                    run["policy"] = p
                    return [res.annotate(run, lengths_of_results(results))]

                _guarded(payload, path, policy, one)
    finally:
        res.close()
    return _finish(payload, path, args, [report.latency_table(payload["runs"]), report.policy_table(payload["runs"])])


def run_soak(args: argparse.Namespace) -> int:
    from loadtest import soak

    soak.validate(args)
    tokenizer = _load_tokenizer(args)
    if args.url and not args.model:
        args.model = served_model(args.url, args.api_key)
    return soak.run_soak(args, tokenizer)


def run_overhead(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from loadtest.overhead import run_overhead as _run

    args.model = args.model or default_model_path()
    return _run(args, AutoTokenizer.from_pretrained(args.model))
