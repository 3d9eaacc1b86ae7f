"""Result files of `kvrelay bench`: one JSON per run with every system's metrics, and the tables
printed from them (burst, poisson, single, policies, rooflines, and `compare` across files).

A result file::

    {"format": "kvrelay-bench/1", "workload": "burst", "command": "...", "parameters": {...},
     "git_commit": "...", "host": {...}, "loadavg_start": [...], "loadavg_end": [...],
     "runs": [{"system": "hf-static-32", "family": "hf-static", "workload": "burst", "cap": 64,
               "qps": null, "metrics": {...vllm bench names...}, "samples": {"ttft": [...], "e2el": [...]},
               "extra": {...}, "roofline": {...}}, ...],
     "ceilings": {...}, "model_shape": {...}}

`ceilings` (the machine's, measured in the run; loadtest/ceilings.py) and each run's `roofline` (its fractions of
them; loadtest/roofline.py) are absent with --no-ceilings and in files from before them.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
from pathlib import Path
from typing import Any, Iterable, Sequence

from loadtest.http_client import RequestResult
from loadtest.results import RunResult, git_commit, loadavg

FORMAT = "kvrelay-bench/1"
SYSTEM_ORDER = ("hf-naive", "hf-static", "engine", "server")
SYSTEM_LABELS = {"hf-naive": "HF naive", "hf-static": "HF static", "engine": "kvrelay engine (offline)",
                 "server": "kvrelay serve (HTTP)", "url": "server at --url"}


def new_payload(workload: str, parameters: dict[str, Any], argv: Sequence[str]) -> dict[str, Any]:
    """The header of a result file; `runs` fills in as systems finish."""
    import torch

    return {
        "format": FORMAT, "workload": workload,
        "command": "kvrelay bench " + shlex.join(argv),
        "parameters": parameters, "git_commit": git_commit(),
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "loadavg_start": loadavg(), "runs": [],
    }


def run_from_offline(result: RunResult, family: str, workload: str, prompt_tokens: int,
                     cap: int | None = None) -> dict[str, Any]:
    """A record for an offline throughput run (HF baselines, `LLM.generate`): no per-token timings."""
    wall = result.wall_s
    metrics = {
        "completed": result.num_requests, "failed": 0, "duration": wall,
        "total_input_tokens": prompt_tokens, "total_output_tokens": result.useful_tokens,
        "request_throughput": result.req_s, "output_throughput": result.useful_tok_s,
        "total_token_throughput": (prompt_tokens + result.useful_tokens) / wall if wall > 0 else 0.0,
        "generated_tokens": result.generated_tokens, "padding_waste": result.padding_waste,
    }
    return {"system": result.system, "family": family, "workload": workload, "cap": cap, "qps": None,
            "metrics": metrics, "samples": {}, "extra": dict(result.extra)}


def run_from_results(system: str, family: str, workload: str, summary: dict[str, Any],
                     results: Sequence[RequestResult], cap: int | None = None, qps: float | None = None,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A record for a timed run (HTTP or the in-process engine), keeping per-request TTFT and e2e. TTFT only
    when tokens were timed one by one (streamed): a whole answer arrives at once, so its "first token" time
    is its latency and its TPOT zero, which the reports and rooflines must not read as a decode rate."""
    ok = [r for r in results if r.success]
    streamed = any(len(r.token_times) > 1 for r in ok)
    samples = {"ttft": [r.ttft for r in ok if r.ttft is not None] if streamed else [],
               "e2el": [r.latency for r in ok]}
    return {"system": system, "family": family, "workload": workload, "cap": cap, "qps": qps,
            "metrics": summary, "samples": samples, "extra": dict(extra or {})}


def write_payload(path: Path, payload: dict[str, Any]) -> Path:
    payload["loadavg_end"] = loadavg()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def load_payload(path: str | Path) -> dict[str, Any]:
    """Read a result file; a ValueError names the file when it isn't one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no such result file: {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("runs"), list):
        raise ValueError(f"{path} is not a kvrelay bench result (expected format {FORMAT!r} with runs)")
    return data


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _markdown(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def best_of_family(runs: Sequence[dict[str, Any]], family: str) -> dict[str, Any] | None:
    """The family's run with the highest output throughput (static batching: its best batch size)."""
    members = [r for r in runs if r["family"] == family and not r["metrics"].get("failed")]
    return max(members, key=lambda r: r["metrics"]["output_throughput"], default=None)


def burst_table(runs: Sequence[dict[str, Any]]) -> str:
    """Per cap: each system's output tok/s and its ratio to HF naive and to HF static (best batch size)."""
    rows = []
    for cap in sorted({r["cap"] for r in runs}):
        at_cap = [r for r in runs if r["cap"] == cap]
        naive, static = best_of_family(at_cap, "hf-naive"), best_of_family(at_cap, "hf-static")
        for family in SYSTEM_ORDER + ("url",):
            run = best_of_family(at_cap, family)
            if run is None:
                continue
            m = run["metrics"]
            tok_s = m["output_throughput"]
            name = SYSTEM_LABELS[family] + (f", batch {run['extra']['batch_size']}" if family == "hf-static" else "")
            rows.append([str(cap), name, _fmt(m["duration"], 2), _fmt(tok_s), _fmt(m["request_throughput"], 2),
                         _fmt(tok_s / naive["metrics"]["output_throughput"], 2) if naive else "-",
                         _fmt(tok_s / static["metrics"]["output_throughput"], 2) if static else "-",
                         str(m.get("failed", 0))])
    return _markdown(["cap", "system", "wall s", "output tok/s", "req/s", "× naive", "× static", "failed"], rows)


def static_table(runs: Sequence[dict[str, Any]]) -> str:
    """Every static batch size, with its padding waste (the best one goes to the burst table)."""
    rows = [[str(r["cap"]), str(r["extra"].get("batch_size")), _fmt(r["metrics"]["duration"], 2),
             _fmt(r["metrics"]["output_throughput"]), f"{r['metrics'].get('padding_waste', 0):.1%}"]
            for r in runs if r["family"] == "hf-static"]
    return _markdown(["cap", "batch size", "wall s", "useful tok/s", "padding waste"], rows)


def latency_table(runs: Sequence[dict[str, Any]], key: str = "qps") -> str:
    """TTFT, TPOT, ITL and e2e latency per run (poisson, policies, or any timed run)."""
    rows = []
    for r in runs:
        m = r["metrics"]
        label = r.get("policy") or SYSTEM_LABELS.get(r["family"], r["system"])
        rows.append([_fmt(r.get(key), 0) if key == "qps" else str(r.get(key)), label,
                     _fmt(m["output_throughput"]), _fmt(m["mean_ttft_ms"], 0), _fmt(m["median_ttft_ms"], 0),
                     _fmt(m["p95_ttft_ms"], 0), _fmt(m["p99_ttft_ms"], 0), _fmt(m["mean_tpot_ms"], 0),
                     _fmt(m["p95_itl_ms"], 0), _fmt(m["mean_e2el_ms"] / 1000, 2), _fmt(m["median_e2el_ms"] / 1000, 2),
                     _fmt(m["p95_e2el_ms"] / 1000, 2), _fmt(m["p99_e2el_ms"] / 1000, 2), str(m["failed"])])
    head = [key, "system", "output tok/s", "TTFT mean ms", "TTFT p50", "TTFT p95", "TTFT p99", "TPOT mean ms",
            "ITL p95 ms", "e2e mean s", "e2e p50 s", "e2e p95 s", "e2e p99 s", "failed"]
    return _markdown(head, rows)


def single_table(runs: Sequence[dict[str, Any]]) -> str:
    """One stream at a time: TTFT, and decode tok/s as 1 / median TPOT (the time per token after the first)."""
    rows = []
    for r in runs:
        m = r["metrics"]
        tpot = m.get("median_tpot_ms") if r["samples"].get("ttft") else None
        rows.append([_label(r), str(m["completed"]), _fmt(m["median_ttft_ms"], 0), _fmt(m["p95_ttft_ms"], 0),
                     _fmt(tpot), _fmt(1000 / tpot if tpot else None), _fmt(m["median_e2el_ms"] / 1000, 2),
                     str(m["failed"])])
    return _markdown(["system", "requests", "TTFT p50 ms", "TTFT p95 ms", "TPOT p50 ms", "decode tok/s", "e2e p50 s",
                      "failed"], rows)


def policy_table(runs: Sequence[dict[str, Any]]) -> str:
    """Mean and p95 end-to-end latency (and TTFT) per scheduling policy, averaged over rounds."""
    rows = []
    for policy in dict.fromkeys(r["policy"] for r in runs if r.get("policy")):
        mine = [r["metrics"] for r in runs if r.get("policy") == policy]

        def avg(key: str) -> float:
            return sum(m[key] for m in mine) / len(mine)

        rows.append([policy, str(len(mine)), _fmt(avg("mean_e2el_ms") / 1000, 2), _fmt(avg("p95_e2el_ms") / 1000, 2),
                     _fmt(avg("mean_ttft_ms"), 0), _fmt(avg("p95_ttft_ms"), 0), _fmt(avg("output_throughput")),
                     str(sum(m["failed"] for m in mine))])
    return _markdown(["policy", "runs", "e2e mean s", "e2e p95 s", "TTFT mean ms", "TTFT p95 ms", "output tok/s",
                      "failed"], rows)


def _group_key(run: dict[str, Any]) -> tuple[str, str]:
    param = f"cap {run['cap']}" if run.get("cap") is not None else (
        f"QPS {run['qps']:g}" if run.get("qps") is not None else "")
    return run["workload"], param


def compare_table(payloads: Sequence[tuple[str, dict[str, Any]]], baseline: str | None = None) -> str:
    """Runs of several result files side by side; ratios within each (workload, cap/QPS) group against
    the run whose system (or family) is ``baseline``, else the group's first run."""
    groups: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
    for name, payload in payloads:
        for run in payload["runs"]:
            groups.setdefault(_group_key(run), []).append((name, run))
    rows = []
    for (workload, param), members in groups.items():
        base = next((r for _, r in members if baseline in (r["system"], r["family"])), None) if baseline else None
        base = base or members[0][1]
        base_tok_s = base["metrics"]["output_throughput"]
        base_e2e = base["metrics"].get("mean_e2el_ms")
        for name, run in members:
            m = run["metrics"]
            e2e = m.get("mean_e2el_ms")
            rows.append([workload, param, f"{run.get('policy') or run['system']} ({name})",
                         _fmt(m["output_throughput"]), _fmt(m["output_throughput"] / base_tok_s, 2) if base_tok_s else "-",
                         _fmt(m.get("median_ttft_ms"), 0) if run["samples"].get("ttft") else "-",
                         _fmt(m.get("p95_ttft_ms"), 0) if run["samples"].get("ttft") else "-",
                         _fmt(e2e / 1000, 2) if e2e and run["samples"].get("e2el") else "-",
                         _fmt(e2e / base_e2e, 2) if e2e and base_e2e and run["samples"].get("e2el")
                         and base["samples"].get("e2el") else "-",
                         str(m.get("failed", 0)), _fraction(run)])
    head = ["workload", "param", "system (file)", "output tok/s", "× tok/s", "TTFT p50 ms", "TTFT p95 ms",
            "e2e mean s", "× e2e", "failed", "× roofline"]
    return _markdown(head, rows)


def _fraction(run: dict[str, Any]) -> str:
    """The run's fraction of the roofline it is judged by, e.g. `0.42 (memory)`; `-` without ceilings."""
    roofline = run.get("roofline") or {}
    fraction = roofline.get("fraction")
    return "-" if fraction is None else f"{fraction:.2f} ({roofline['bound']})"


def _label(run: dict[str, Any]) -> str:
    if run.get("policy"):
        return str(run["policy"])
    batch = run["extra"].get("batch_size") if run["family"] == "hf-static" else None
    return SYSTEM_LABELS.get(run["family"], run["system"]) + (f", batch {batch}" if batch else "")


def ceilings_text(ceilings: dict[str, Any]) -> str:
    """The machine's ceilings measured in this run (loadtest/ceilings.py), as a two-column table."""
    c = ceilings
    flags = ", ".join(f"{f} {'yes' if c['cpu']['flags'].get(f) else 'no'}" for f in ("avx512_bf16", "amx_bf16"))
    per_shape = ", ".join(f"{k} {v:,.0f}" for k, v in c["matmul_gflops"].items() if k != "lm_head")
    gemv = ", ".join(f"{k} {v:,.1f}" for k, v in c["gemv_gbs"].items())
    compiled = sorted({v for v in c.get("gemv_kernels", {}).values() if v != "F.linear"})
    gemv_how = f", the faster of F.linear and {' / '.join(compiled)}" if compiled else ""
    packed = ", the faster of F.linear and packed weights" if c.get("matmul_gflops_packed") else ""
    title = (f"Ceilings of this machine ({c['cpu']['model_name']}, {flags}; {c['threads']} thread{'s' if c['threads'] != 1 else ''}, {c['dtype']}, "
             f"{c['device']}; load average {c['loadavg'][0]:.1f} at the measurement; {c['seconds']:.1f} s):")
    rows = [
        [f"matmul at the model's layer shapes, {c['rows']} rows{packed}", f"{c['layer_gflops']:,.0f} GFLOP/s ({per_shape})"],
        [f"LM head matmul, {c['rows']} rows", f"{c['lm_head_gflops']:,.0f} GFLOP/s"],
        [f"{c.get('reference_dtype', 'bfloat16')} 2048³ matmul", f"{c['reference_gflops']:,.0f} GFLOP/s (1 thread {c['reference_gflops_1_thread']:,.0f})"],
        [f"every matmul at 1 row (GEMV), each layer its own weights{gemv_how}",
         f"{c['gemv_forward_ms']:,.1f} ms per token = {c['gemv_tok_s']:,.1f} tok/s (GB/s: {gemv})"],
        ["memory read bandwidth (best / median)", f"{c['read_gbs']:,.1f} / {c['read_gbs_median']:,.1f} GB/s "
         f"(1 thread {c['read_gbs_1_thread']:,.1f} / {c['read_gbs_1_thread_median']:,.1f})"],
    ]
    return title + "\n\n" + _markdown(["ceiling", "measured"], rows)


def roofline_table(runs: Sequence[dict[str, Any]]) -> str:
    """Each run as fractions of its rooflines: achieved GFLOP/s over the matmul ceiling for the workload's FLOPs,
    per-stream decode tok/s over the bandwidth ceiling (weights + KV bytes per token), and the lockstep engine's
    least time over the run's (with the most of the compute roofline that engine reaches); `bound` is the one the
    workload is judged by. Files from before the lockstep bound show `-` there."""
    rows = []
    for r in runs:
        rf = r.get("roofline")
        if not rf:
            continue
        _, param = _group_key(r)
        rows.append([r["workload"], param, _label(r), rf["bound"], _fmt(r["metrics"]["output_throughput"]),
                     _fmt(rf["flops"] / 1e12, 2), _fmt(rf["achieved_gflops"]), _fmt(rf["compute_seconds"], 2),
                     _fmt(rf["compute_fraction"], 2), _fmt(rf["bytes_per_token"] / 1e6, 0), _fmt(rf["decode_tok_s"]),
                     _fmt(rf["decode_ceiling_tok_s"]), _fmt(rf["decode_fraction"], 2), _fmt(rf.get("lockstep_seconds"), 2),
                     _fmt(rf.get("lockstep_fraction"), 2), _fmt(rf.get("attainable_compute_fraction"), 2)])
    head = ["workload", "param", "system", "bound", "output tok/s", "TFLOP", "GFLOP/s", "roofline s",
            "× compute roofline", "MB/token", "decode tok/s", "ceiling tok/s", "× bandwidth roofline", "lockstep s",
            "× lockstep", "lockstep × compute roofline"]
    return _markdown(head, rows) if rows else ""


def roofline_tables(payload: dict[str, Any]) -> list[str]:
    """The ceilings and the rooflines table of a result, or nothing when it has no ceilings (--no-ceilings, or a
    file from before them)."""
    if not payload.get("ceilings"):
        return []
    return [t for t in (ceilings_text(payload["ceilings"]), roofline_table(payload["runs"])) if t]
