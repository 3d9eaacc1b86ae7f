"""Serving metrics over ``RequestResult`` lists, named and printed like ``vllm bench serve``."""

from __future__ import annotations

from typing import Any

import numpy as np

from loadtest.http_client import RequestResult

PERCENTILES = (90, 95, 99)
MAX_ERROR_KINDS = 10
LATENCY_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
WIDTH = 50


def tpot(result: RequestResult) -> float | None:
    """Mean seconds per output token after the first, or None with < 2 tokens or no TTFT."""
    if result.ttft is None or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def latency_stats(name: str, values_s: list[float]) -> dict[str, float]:
    """mean/median/std/p90/p95/p99 of ``values_s`` in ms as ``mean_{name}_ms`` etc.; 0 when empty."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    stats = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    stats.update({f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES})
    return stats


def error_counts(results: list[RequestResult]) -> dict[str, int]:
    """Count failed requests per error message, keeping the first 10 distinct messages."""
    counts: dict[str, int] = {}
    for r in results:
        if r.success:
            continue
        message = r.error or "unknown error"
        if message in counts or len(counts) < MAX_ERROR_KINDS:
            counts[message] = counts.get(message, 0) + 1
    return counts


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Benchmark summary: counts, throughputs and latency stats of the successful requests only."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
    }
    samples = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for t in map(tpot, ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, values in samples.items():
        summary.update(latency_stats(name, values))
    summary["errors"] = error_counts(results)
    return summary


def _row(label: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text}"


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """Plain-text result table in the layout of vLLM's ``Serving Benchmark Result``."""
    lines = [
        f" {title} ".center(WIDTH, "="),
        _row("Successful requests:", summary["completed"]),
        _row("Failed requests:", summary["failed"]),
        _row("Benchmark duration (s):", float(summary["duration"])),
        _row("Total input tokens:", summary["total_input_tokens"]),
        _row("Total generated tokens:", summary["total_output_tokens"]),
        _row("Request throughput (req/s):", summary["request_throughput"]),
        _row("Output token throughput (tok/s):", summary["output_throughput"]),
        _row("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for key, short, heading in LATENCY_SECTIONS:
        lines.append(heading.center(WIDTH, "-"))
        lines.append(_row(f"Mean {short} (ms):", summary[f"mean_{key}_ms"]))
        lines.append(_row(f"Median {short} (ms):", summary[f"median_{key}_ms"]))
        lines.append(_row(f"Std {short} (ms):", summary[f"std_{key}_ms"]))
        lines.extend(_row(f"P{p} {short} (ms):", summary[f"p{p}_{key}_ms"]) for p in PERCENTILES)
    errors = summary.get("errors") or {}
    if errors:
        lines.append("Errors".center(WIDTH, "-"))
        lines.extend(f"{count:>6}  {message}" for message, count in errors.items())
    lines.append("=" * WIDTH)
    return "\n".join(lines)
