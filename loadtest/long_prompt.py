"""The `long-prompt` workload against colocated and disaggregated `kvrelay serve`, one after the other in
one Ray cluster, plus KV transfer throughput per transport on a 2,048-token prompt.

`python -m loadtest long-prompt --out docs/results`."""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request
from typing import Any

from loadtest import report, runners
from loadtest.http_client import run_load
from loadtest.metrics import latency_stats
from loadtest.overhead import MODEL_NAME, LocalCluster
from loadtest.workloads import BenchRequest, corpus_tokens, long_prompt_requests

LONG_PROMPT = 2048
MAX_MODEL_LEN = LONG_PROMPT + 256

# Same model, dtype and cache for all; the two pools of the disaggregated run split the two cores.
COMMON = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "1GiB"}
CONFIGS: dict[str, dict[str, Any]] = {
    "colocated, chunked prefill off": {"enable_chunked_prefill": False, "max_num_batched_tokens": MAX_MODEL_LEN},
    "colocated, budget 256": {"max_num_batched_tokens": 256},
    "colocated, budget 512": {"max_num_batched_tokens": 512},
    "disaggregated 1+1": {"disaggregate": True, "kv_transport": "object_store",
                          "prefill_engine": {"num_threads": 1, "max_num_batched_tokens": MAX_MODEL_LEN},
                          "decode_engine": {"num_threads": 1}},
}


def split_stats(results, requests: list[BenchRequest]) -> dict[str, Any]:
    """TTFT p50/p95 and ITL p95 (ms) for short and long requests separately."""
    out: dict[str, Any] = {}
    for kind, want_long in (("short", False), ("long", True)):
        rs = [r for r, q in zip(results, requests) if (len(q.prompt_token_ids) == LONG_PROMPT) == want_long and r.success]
        ttft = latency_stats("ttft", [r.ttft for r in rs if r.ttft is not None])
        itl = latency_stats("itl", [g for r in rs for g in r.itl])
        out[kind] = {"completed": len(rs), "ttft_p50_ms": ttft["median_ttft_ms"], "ttft_p95_ms": ttft["p95_ttft_ms"],
                     "itl_p95_ms": itl["p95_itl_ms"]}
    out["failed"] = sum(not r.success for r in results)
    return out


def _metric_sums(url: str, names: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """{(sample name, role): value summed over replicas} for the KV transfer metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    sums = {(n, role): 0.0 for n in names for role in ("send", "receive")}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, s.labels.get("role"))
            if key in sums:
                sums[key] += s.value
    return sums


def transfer_throughput(cluster: LocalCluster, tokenizer_ids: list[int], transports: list[str],
                        repeats: int = 5) -> list[dict[str, Any]]:
    """Per transport, for a 2,048-token prompt: the prefill side's offer time, the decode side's fetch
    time, and MB/s over both (packing in the engine thread is not included)."""
    rows = []
    for transport in transports:
        name = f"xfer-{transport.replace('_', '')}"
        url = cluster.deploy(name, {**COMMON, "disaggregate": True, "kv_transport": transport})
        names = ("kvrelay:kv_transfer_bytes_total", "kvrelay:kv_transfer_seconds_sum", "kvrelay:kv_transfers_total")
        before = _metric_sums(url, names)
        for i in range(repeats):
            prompt = tokenizer_ids[i * 7:i * 7 + LONG_PROMPT]
            asyncio.run(run_load(url, MODEL_NAME, [BenchRequest(prompt, 2)], stream=False, progress=False))
        after = _metric_sums(url, names)
        delta = {k: after[k] - before[k] for k in after}
        n = max(1.0, delta[("kvrelay:kv_transfers_total", "receive")])
        send_s, recv_s = (delta[("kvrelay:kv_transfer_seconds_sum", role)] for role in ("send", "receive"))
        nbytes = delta[("kvrelay:kv_transfer_bytes_total", "receive")]
        rows.append({"transport": transport, "transfers": n, "mb_per_transfer": nbytes / n / 1e6,
                     "offer_ms": 1e3 * send_s / n, "fetch_ms": 1e3 * recv_s / n,
                     "mb_per_s": nbytes / (send_s + recv_s) / 1e6 if send_s + recv_s else 0.0})
        cluster.delete(name)
    return rows


def run(tokenizer, corpus_ids: list[int], transports: list[str], configs: list[str] | None = None,
        num_requests: int | None = None) -> dict[str, Any]:
    requests = long_prompt_requests(tokenizer)[: num_requests or None]
    rows = []
    with LocalCluster() as cluster:
        for i, label in enumerate(CONFIGS if configs is None else configs):
            name = f"lp{i}"
            url = cluster.deploy(name, {**COMMON, **CONFIGS[label]})
            asyncio.run(run_load(url, MODEL_NAME, [BenchRequest(requests[0].prompt_token_ids[:8], 2)], progress=False))
            start = time.perf_counter()
            results, duration = asyncio.run(run_load(url, MODEL_NAME, requests, stream=True, progress=False))
            rows.append({"config": label, "options": CONFIGS[label], "duration": duration,
                         "wall": time.perf_counter() - start, **split_stats(results, requests)})
            cluster.delete(name)
        transfers = transfer_throughput(cluster, corpus_ids, transports)
    return {"long_prompt": rows, "transfers": transfers}


def format_tables(payload: dict[str, Any]) -> str:
    lines = ["| config | short TTFT p50 ms | short TTFT p95 ms | short ITL p95 ms | long TTFT p50 ms | "
             "long TTFT p95 ms | long ITL p95 ms | failed |", "|---|---|---|---|---|---|---|---|"]
    for r in payload["long_prompt"]:
        s, lg = r["short"], r["long"]
        lines.append(f"| {r['config']} | {s['ttft_p50_ms']:.0f} | {s['ttft_p95_ms']:.0f} | {s['itl_p95_ms']:.0f} | "
                     f"{lg['ttft_p50_ms']:.0f} | {lg['ttft_p95_ms']:.0f} | {lg['itl_p95_ms']:.0f} | {r['failed']} |")
    lines += ["", "| transport | transfers | MB per transfer | offer ms | fetch ms | MB/s (offer + fetch) |",
              "|---|---|---|---|---|---|"]
    for t in payload["transfers"]:
        lines.append(f"| {t['transport']} | {t['transfers']:.0f} | {t['mb_per_transfer']:.1f} | {t['offer_ms']:.1f} | "
                     f"{t['fetch_ms']:.1f} | {t['mb_per_s']:.0f} |")
    return "\n".join(lines)


def run_long_prompt(args: argparse.Namespace) -> int:
    """`kvrelay bench long-prompt`: the workload against --url, or else the colocated/disaggregated suite."""
    sampling = runners.sampling_options(args)
    if sampling and not args.url:
        raise ValueError("the long-prompt suite decodes greedily; --temperature needs --url")
    tokenizer = runners._load_tokenizer(args)
    if args.url:
        from loadtest.metrics import summarize

        requests = long_prompt_requests(tokenizer)[: args.num_requests or None]
        payload = report.new_payload("long-prompt", {"url": args.url, "num_requests": len(requests),
                                                     "sampling": sampling}, args.argv)
        path = args.out / f"long-prompt-{runners._stamp()}.json"
        res = runners.Systems(args)
        results, duration = runners.timed_run("url", requests, args, res, args.stream)
        result = report.run_from_results(args.url, "url", "long-prompt", summarize(results, duration), results,
                                         extra=split_stats(results, requests))
        payload["runs"].append(result)
        s, lg = result["extra"]["short"], result["extra"]["long"]
        table = (f"short: TTFT p50 {s['ttft_p50_ms']:.0f} ms, p95 {s['ttft_p95_ms']:.0f} ms, ITL p95 {s['itl_p95_ms']:.0f} ms\n"
                 f"long:  TTFT p50 {lg['ttft_p50_ms']:.0f} ms, p95 {lg['ttft_p95_ms']:.0f} ms, ITL p95 {lg['itl_p95_ms']:.0f} ms")
        return runners._finish(payload, path, args, [table])
    from loadtest.results import git_commit, loadavg, write_json

    payload = {"workload": "long-prompt", "parameters": {k: str(v) for k, v in vars(args).items()},
               "git_commit": git_commit(), "loadavg_start": loadavg()}
    payload.update(run(tokenizer, corpus_tokens(tokenizer), args.transports, args.configs, args.num_requests))
    payload["loadavg_end"] = loadavg()
    path = args.out / f"long-prompt-{runners._stamp()}.json"
    write_json(path, payload)
    print(format_tables(payload))
    print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for r in payload["long_prompt"]) else 1
