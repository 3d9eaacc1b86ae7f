"""The soak's arithmetic and verdict: outcome counts, errors by type, latency percentiles, replica memory
growth, the engine's state once idle, and the checks that set the exit status (no request lost, KV cache
empty and nothing running or waiting at the end, replica memory grown by at most the allowed share)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from loadtest.metrics import summarize
from loadtest.soak_client import Outcome, SoakResult
from loadtest.soak_probe import ServerState

MIB = 1024 * 1024


def outcome_counts(results: Sequence[SoakResult], sent: int | None = None) -> dict[str, int]:
    """sent / completed / errored / disconnected / lost; a request sent without any outcome counts as lost."""
    by = Counter(r.outcome for r in results)
    sent = len(results) if sent is None else sent
    known = by[Outcome.COMPLETED] + by[Outcome.ERRORED] + by[Outcome.DISCONNECTED]
    return {"sent": sent, "completed": by[Outcome.COMPLETED], "errored": by[Outcome.ERRORED],
            "disconnected": by[Outcome.DISCONNECTED], "lost": sent - known}


def errors_by_type(results: Sequence[SoakResult]) -> dict[str, int]:
    """Errored and lost requests per error type (e.g. `HTTP 503`, `stream cut`, `timeout`), most common first."""
    counts = Counter(r.error_type or "unknown" for r in results if r.outcome in (Outcome.ERRORED, Outcome.LOST))
    return dict(counts.most_common())


def summarize_soak(results: Sequence[SoakResult], duration: float, sent: int | None = None) -> dict[str, Any]:
    """The bench metrics (`loadtest.metrics.summarize`) over every request but those we cut off ourselves, so
    `failed` = errored + lost; TTFT covers streamed requests only (a plain answer arrives whole), e2e all
    completed ones. Plus the outcome counts and errors by type."""
    timings = [r.timing for r in results if r.outcome is not Outcome.DISCONNECTED]
    metrics = summarize(timings, duration)
    metrics.update(outcome_counts(results, sent))
    metrics["errors_by_type"] = errors_by_type(results)
    return metrics


@dataclass
class RssReport:
    """Engine replica RSS (bytes, summed over replicas): before the warm-up, after it (the baseline), half-way
    through the load, at the end once idle, and the largest sample."""

    pids: list[int]
    before_warmup: int | None = None
    start: int | None = None
    mid: int | None = None
    end: int | None = None
    peak: int | None = None
    note: str | None = None  # why it was not measured

    @property
    def growth(self) -> float | None:
        """(end - start) / start, from the warmed-up baseline."""
        return _growth(self.start, self.end)

    @property
    def second_half_growth(self) -> float | None:
        """(end - mid) / mid: a leak keeps growing here, memory that settles after the first requests does not."""
        return _growth(self.mid, self.end)

    def add_samples(self, samples: Sequence[tuple[float, int | None]], duration: float) -> None:
        """Take the peak and the half-way value from the samples taken during the load ([(seconds, bytes)])."""
        values = [b for _, b in samples if b is not None] + [b for b in (self.start, self.end) if b is not None]
        self.peak = max(values, default=None)
        measured = [(t, b) for t, b in samples if b is not None]
        if measured:
            self.mid = min(measured, key=lambda s: abs(s[0] - duration / 2))[1]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "growth": self.growth, "second_half_growth": self.second_half_growth}


def _growth(before: int | None, after: int | None) -> float | None:
    return None if not before or after is None else (after - before) / before


def checks(lost: int, start: ServerState | None, end: ServerState | None, rss: RssReport,
           max_rss_growth: float) -> list[tuple[str, bool | None, str]]:
    """(check, passed or None when not measured, detail) for each condition of a clean soak. What could be
    read at the start but not at the end (a replica killed or restarted, `/metrics` gone) fails."""
    out: list[tuple[str, bool | None, str]] = [("no request lost", lost == 0, f"{lost} lost")]
    if end is not None:
        out.append(("engine idle at the end", end.idle, f"KV usage {end.kv_usage:.4f}, running {end.running:g}, "
                                                        f"waiting {end.waiting:g}"))
    elif start is not None:
        out.append(("engine idle at the end", False, "the engine gauges were gone from /metrics at the end"))
    else:
        out.append(("engine idle at the end", None, "no kvrelay engine gauges at /metrics"))
    growth = rss.growth
    if growth is not None:
        out.append((f"replica RSS growth <= {max_rss_growth:.0%}", growth <= max_rss_growth,
                    f"{growth:+.1%} ({rss.start / MIB:.0f} -> {rss.end / MIB:.0f} MiB)"))
    elif rss.start is not None:
        out.append(("replica RSS growth", False, f"engine replica process {', '.join(map(str, rss.pids))} gone by "
                                                 "the end (killed or restarted)"))
    else:
        out.append(("replica RSS growth", None, rss.note or "replica RSS not measured"))
    return out


def failed(check_list: Sequence[tuple[str, bool | None, str]]) -> bool:
    return any(ok is False for _, ok, _ in check_list)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.0f} MiB"


def counter_delta(start: ServerState | None, end: ServerState | None) -> dict[str, float]:
    """Engine sequences finished during the soak by finish reason, and preemptions (counters end - start)."""
    if start is None or end is None:
        return {}
    out = {f"finished_{k}": v - start.finished.get(k, 0.0) for k, v in sorted(end.finished.items())}
    out["preemptions"] = end.preemptions - start.preemptions
    return out


def format_soak(metrics: dict[str, Any], rss: RssReport, end: ServerState | None, idle_wait_s: float,
                delta: dict[str, float], check_list: Sequence[tuple[str, bool | None, str]]) -> str:
    """The printed summary."""
    m = metrics
    lines = ["=" * 20 + " Soak " + "=" * 20,
             f"requests sent {m['sent']}: completed {m['completed']}, errored {m['errored']}, "
             f"disconnected by us {m['disconnected']}, lost {m['lost']}",
             f"duration {m['duration']:.1f} s, {m['request_throughput']:.2f} req/s, "
             f"{m['output_throughput']:.1f} output tok/s, {m['duration'] / max(1, m['sent']) * 1000:.0f} ms per request"]
    for kind, count in m["errors_by_type"].items():
        lines.append(f"  error {kind}: {count}")
    for message, count in (m.get("errors") or {}).items():
        lines.append(f"    {count:>6}  {message[:160]}")
    for key, label in (("ttft", "TTFT (streamed)"), ("e2el", "e2e latency")):
        lines.append(f"{label:<16} ms: p50 {m[f'median_{key}_ms']:,.0f}  p90 {m[f'p90_{key}_ms']:,.0f}  "
                     f"p95 {m[f'p95_{key}_ms']:,.0f}  p99 {m[f'p99_{key}_ms']:,.0f}  mean {m[f'mean_{key}_ms']:,.0f}")
    growth, half = (("-" if g is None else f"{g:+.1%}") for g in (rss.growth, rss.second_half_growth))
    lines.append(f"replica RSS (pids {', '.join(map(str, rss.pids)) or '-'}): before warm-up {_mib(rss.before_warmup)}, "
                 f"start {_mib(rss.start)}, half-way {_mib(rss.mid)}, end {_mib(rss.end)}, peak {_mib(rss.peak)}; "
                 f"growth {growth} (second half {half})")
    if end is not None:
        lines.append(f"engine after {idle_wait_s:.1f} s idle wait: KV usage {end.kv_usage:.4f}, running "
                     f"{end.running:g}, waiting {end.waiting:g}")
    if delta:
        lines.append("engine during the soak: " + ", ".join(f"{k} {v:g}" for k, v in delta.items()))
    if "replica_cpu_s" in delta:
        lines.append(f"engine replica CPU {delta['replica_cpu_s'] / max(1, m['sent']) * 1000:.0f} ms per request")
    for name, ok, detail in check_list:
        lines.append(f"[{'PASS' if ok else 'FAIL' if ok is False else 'NOT MEASURED'}] {name}: {detail}")
    lines.append("=" * 46)
    return "\n".join(lines)
