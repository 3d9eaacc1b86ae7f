"""PNG plots of `kvrelay bench` results (matplotlib, headless): the classic grouped throughput bars,
throughput relative to static batching, and latency CDFs per system and request rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from loadtest.report import SYSTEM_LABELS, SYSTEM_ORDER, best_of_family

FAMILIES = SYSTEM_ORDER + ("url",)
COLORS = {"hf-naive": "#9e9e9e", "hf-static": "#5b8def", "engine": "#f28e2b", "server": "#2ca02c", "url": "#8c564b"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_burst(runs: Sequence[dict[str, Any]], out_dir: Path, stem: str) -> list[Path]:
    """`{stem}-throughput.png` (output tok/s per system and cap) and `{stem}-relative.png` (× HF static)."""
    plt = _pyplot()
    caps = sorted({r["cap"] for r in runs})
    best = {(cap, fam): best_of_family([r for r in runs if r["cap"] == cap], fam) for cap in caps for fam in FAMILIES}
    families = [f for f in FAMILIES if any(best[(cap, f)] for cap in caps)]
    x = np.arange(len(caps))
    width = 0.8 / max(1, len(families))
    paths = []
    for kind in ("throughput", "relative"):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, fam in enumerate(families):
            values = []
            for cap in caps:
                run, static = best[(cap, fam)], best[(cap, "hf-static")]
                tok_s = run["metrics"]["output_throughput"] if run else 0.0
                if kind == "relative":
                    tok_s = tok_s / static["metrics"]["output_throughput"] if static and run else 0.0
                values.append(tok_s)
            bars = ax.bar(x + (i - (len(families) - 1) / 2) * width, values, width, color=COLORS[fam],
                          label=SYSTEM_LABELS[fam])
            ax.bar_label(bars, labels=[f"{v:.1f}" if kind == "relative" else f"{v:.0f}" for v in values],
                         fontsize=7, padding=2)
        ax.set_xticks(x, [f"cap {c}" for c in caps])
        ax.set_xlabel("maximum output length (burst: 256 requests, 128 prompt tokens)")
        if kind == "relative":
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_ylabel("throughput relative to HF static batching (best batch size)")
        else:
            ax.set_ylabel("generated tokens / s")
        ax.set_title("burst: throughput per system" if kind == "throughput" else "burst: throughput vs static batching")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{stem}-{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _run_label(run: dict[str, Any]) -> str:
    return run.get("label") or run.get("policy") or SYSTEM_LABELS.get(run["family"], run["system"])


def plot_latency_cdfs(runs: Sequence[dict[str, Any]], out_dir: Path, stem: str, title: str) -> list[Path]:
    """`{stem}-cdf.png`: TTFT (top) and end-to-end latency (bottom) CDFs, one column per request rate,
    one line per system (or policy)."""
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter

    timed = [r for r in runs if r["samples"].get("e2el")]
    if not timed:
        return []
    rates = sorted({r["qps"] for r in timed}, key=lambda q: (q is None, q))
    fig, axes = plt.subplots(2, len(rates), figsize=(4.2 * len(rates), 6.5), squeeze=False)
    for col, qps in enumerate(rates):
        for run in (r for r in timed if r["qps"] == qps):
            for row, key in enumerate(("ttft", "e2el")):
                values = np.sort(np.asarray(run["samples"].get(key) or [np.nan], dtype=float))
                ax = axes[row][col]
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=_run_label(run),
                        color=None if run.get("policy") or run.get("label") else COLORS.get(run["family"]))
        for row, name in enumerate(("time to first token (s)", "end-to-end latency (s)")):
            ax = axes[row][col]
            ax.set_xlabel(name)
            ax.set_ylabel("fraction of requests")
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.grid(alpha=0.3, which="both")
            ax.set_title(f"QPS {qps:g}" if qps is not None else "")
        axes[0][col].legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / f"{stem}-cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_payload(payload: dict[str, Any], json_path: Path) -> list[Path]:
    """Every plot that suits the file's workload, written next to it with the same stem."""
    stem, out_dir, runs = json_path.stem, json_path.parent, payload["runs"]
    paths: list[Path] = []
    if payload["workload"] == "burst":  # throughput only: all requests arrive at once
        return plot_burst(runs, out_dir, stem)
    title = {"poisson": "poisson: latency CDFs per system and QPS",
             "policies": "poisson: latency CDFs per scheduling policy"}.get(payload["workload"], payload["workload"])
    paths += plot_latency_cdfs(runs, out_dir, stem, title)
    return paths


def plot_together(payloads: Sequence[dict[str, Any]], labels: Sequence[str] | None, stem: Path) -> list[Path]:
    """The runs of several result files of one workload in one figure, `{stem}-*.png`; `labels` names each
    file's runs in the legend."""
    workloads = sorted({p["workload"] for p in payloads})
    if len(workloads) != 1:
        raise ValueError(f"--together draws one workload, and these files hold {', '.join(workloads)}")
    if labels is not None and len(labels) != len(payloads):
        raise ValueError(f"--labels names {len(labels)} files, and {len(payloads)} were given")
    runs = [{**run, "label": label} if label else run
            for p, label in zip(payloads, labels or [None] * len(payloads)) for run in p["runs"]]
    return plot_payload({**payloads[0], "runs": runs}, stem.with_suffix(".json"))
