"""`kvrelay bench soak`: thousands of small mixed requests against one server at a fixed concurrency, to
find what only shows over time: requests that never get an answer, KV blocks or requests that stay behind
once the server is idle, and engine replica memory that keeps growing.

The target is `--url`, or a fresh `kvrelay serve` app on a private local Ray cluster. An untimed warm-up
of the same mix runs first, and the replica's memory after it is the baseline the growth is measured
against (the first requests fill allocator caches and compile kernels; that is not a leak)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlparse

from loadtest import report
from loadtest.soak_client import SoakRequest, SoakResult, run_soak_load
from loadtest.soak_mix import SoakMix, mix_counts, soak_requests
from loadtest.soak_probe import (RssSampler, cpu_seconds, engine_replica_pids, replica_of, scrape, total_rss,
                                 wait_idle)
from loadtest.soak_report import (RssReport, checks, counter_delta, failed, format_soak, outcome_counts,
                                  summarize_soak)
from loadtest.workloads import corpus_tokens

LOCAL_APP = "soak"


@dataclass
class Target:
    """Where the soak sends requests, and the engine replica processes to watch (empty: not on this host)."""

    url: str
    model: str
    pids: list[int]
    note: str | None = None


def _replica_pids(app: str | None) -> tuple[list[int], str | None]:
    """The engine replicas of `app` (or of the only app), preferring a Ray cluster this process started."""
    found = engine_replica_pids(app, ancestor=os.getpid()) or engine_replica_pids(app)
    apps = {replica[0] for replica in map(replica_of, found.values()) if replica}
    if not found:
        where = f"of Serve app {app!r} " if app else ""
        return [], f"no engine replica process {where}on this host; pass --replica-pid"
    if len(apps) > 1:
        return [], f"engine replicas of several Serve apps ({', '.join(sorted(apps))}); pass --serve-app or --replica-pid"
    return sorted(found), None


def serve_app_of(url: str) -> str | None:
    """`kvrelay serve` serves at `/`; apps deployed under a route prefix `/<name>` are named `<name>`."""
    path = [p for p in urlparse(url).path.split("/") if p and p != "v1"]
    return path[0] if path else None


@contextmanager
def soak_target(args: argparse.Namespace) -> Iterator[Target]:
    """`--url` as it is (`args.model` is then the served model's name), or a fresh `kvrelay serve` app on a
    private local Ray cluster, shut down after."""
    if args.url:
        if args.replica_pid:
            yield Target(args.url, args.model, sorted(args.replica_pid))
            return
        pids, note = _replica_pids(args.serve_app or serve_app_of(args.url))
        yield Target(args.url, args.model, pids, note)
        return
    from loadtest.overhead import MODEL_NAME, LocalCluster

    options = {"dtype": args.dtype, **dict(args.engine_option)}
    if args.model:
        options["model"] = args.model
    with LocalCluster() as cluster:
        url = cluster.deploy(LOCAL_APP, options)
        pids, note = _replica_pids(LOCAL_APP)
        if not pids:
            raise ValueError(f"started `kvrelay serve` but cannot watch its memory: {note}")
        yield Target(url, MODEL_NAME, pids)


def build_requests(args: argparse.Namespace, tokenizer: Any) -> tuple[SoakMix, list[SoakRequest], list[SoakRequest]]:
    """The mix of the command line, and its warm-up and measured requests (different seeds)."""
    mix = mix_of(args)
    tokens = corpus_tokens(tokenizer)
    return (mix, soak_requests(tokens, tokenizer.decode, args.warmup, mix, seed=args.seed + 1),
            soak_requests(tokens, tokenizer.decode, args.num_requests, mix, seed=args.seed))


async def _measured(target: Target, requests: list[SoakRequest], args: argparse.Namespace
                    ) -> tuple[list[SoakResult], float, RssSampler]:
    sampler = RssSampler(target.pids, args.rss_interval)
    sampler.start()
    try:
        results, duration = await run_soak_load(target.url, target.model, requests, concurrency=args.concurrency,
                                                api_key=args.api_key, timeout_s=args.timeout, progress=args.progress)
    finally:
        await sampler.stop()
    return results, duration, sampler


def run_soak(args: argparse.Namespace, tokenizer: Any) -> int:
    mix, warmup, requests = build_requests(args, tokenizer)
    params = {"num_requests": args.num_requests, "concurrency": args.concurrency, "warmup": args.warmup,
              "seed": args.seed, "timeout": args.timeout, "url": args.url, "model": args.model, "dtype": args.dtype,
              "engine_options": dict(args.engine_option), "max_rss_growth": args.max_rss_growth,
              "idle_timeout": args.idle_timeout, "mix": asdict(mix), "mix_counts": mix_counts(requests)}
    payload = report.new_payload("soak", params, args.argv)
    path = args.out / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    with soak_target(args) as target:
        rss = RssReport(target.pids, note=target.note, before_warmup=total_rss(target.pids))
        print(f"soak: {len(requests)} requests at concurrency {args.concurrency} against {target.url} "
              f"(engine replica pids: {', '.join(map(str, target.pids)) or target.note})", file=sys.stderr)
        warm, _ = asyncio.run(run_soak_load(target.url, target.model, warmup, concurrency=args.concurrency,
                                            api_key=args.api_key, timeout_s=args.timeout, progress=args.progress,
                                            desc="warm-up"))
        wait_idle(target.url, args.idle_timeout)
        rss.start, start_state, cpu_start = total_rss(target.pids), scrape(target.url), cpu_seconds(target.pids)
        results, duration, sampler = asyncio.run(_measured(target, requests, args))
        end_state, idle_wait_s = wait_idle(target.url, args.idle_timeout)
        rss.end, cpu_end = total_rss(target.pids), cpu_seconds(target.pids)
    rss.add_samples(sampler.samples, duration)
    metrics = summarize_soak(results, duration, sent=len(requests))
    warm_counts = outcome_counts(warm, sent=len(warmup))
    delta = counter_delta(start_state, end_state)
    if cpu_start is not None and cpu_end is not None:  # the load-independent cost: CPU the engine replica spent
        delta["replica_cpu_s"] = round(cpu_end - cpu_start, 1)
    check_list = checks(metrics["lost"] + warm_counts["lost"], start_state, end_state, rss, args.max_rss_growth / 100)
    ok = [r for r in results if r.timing.success]
    payload["runs"].append({
        "system": args.url or "server", "family": "url" if args.url else "server", "workload": "soak", "cap": None,
        "qps": None, "metrics": metrics,
        "samples": {"ttft": [r.timing.ttft for r in ok if r.timing.ttft is not None],
                    "e2el": [r.timing.latency for r in ok]},
        "extra": {"warmup": warm_counts, "rss": rss.to_json(), "rss_samples": sampler.samples,
                  "server_start": None if start_state is None else asdict(start_state),
                  "server_end": None if end_state is None else asdict(end_state), "idle_wait_s": idle_wait_s,
                  "engine_delta": delta,
                  "checks": [{"check": n, "passed": p, "detail": d} for n, p, d in check_list]}})
    report.write_payload(path, payload)
    print(format_soak(metrics, rss, end_state, idle_wait_s, delta, check_list))
    print(f"wrote {path}")
    return 1 if failed(check_list) else 0


def mix_of(args: argparse.Namespace) -> SoakMix:
    return SoakMix(max_prompt_len=args.max_prompt_len, max_max_tokens=args.max_tokens,
                   disconnect_share=args.disconnect_fraction)


def validate(args: argparse.Namespace) -> None:
    """Refuse a bad command line before anything loads."""
    mix_of(args)
    for name in ("num_requests", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.timeout > 0 or args.idle_timeout < 0 or args.max_rss_growth < 0 or not args.rss_interval > 0:
        raise ValueError("--timeout and --rss-interval must be > 0, --idle-timeout and --max-rss-growth >= 0")
