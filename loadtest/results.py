"""Result record for one system run, plus table printing and JSON output."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunResult:
    """Timing and token accounting of one system on one workload."""

    system: str
    num_requests: int
    wall_s: float
    useful_tokens: int
    generated_tokens: int  # includes static-batching padding waste
    loadavg_start: tuple[float, float, float] = (0.0, 0.0, 0.0)
    loadavg_end: tuple[float, float, float] = (0.0, 0.0, 0.0)
    extra: dict[str, Any] = field(default_factory=dict)
    token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def useful_tok_s(self) -> float:
        return self.useful_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def req_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def padding_waste(self) -> float:
        """Fraction of generated tokens that nobody asked for."""
        return 1.0 - self.useful_tokens / self.generated_tokens if self.generated_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("token_ids")
        d.update(useful_tok_s=self.useful_tok_s, req_s=self.req_s, padding_waste=self.padding_waste)
        return d


def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the repo, or None when unavailable."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def loadavg() -> tuple[float, float, float]:
    """``os.getloadavg()``, or zeros where unsupported."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def format_table(results: list[RunResult]) -> str:
    """Plain-text table with a speed-up column against each HF baseline present."""
    baselines = [r for r in results if r.system.startswith("hf-")]
    head = ["system", "wall s", "useful tok/s", "req/s", "pad waste"]
    head += [f"x vs {b.system}" for b in baselines]
    rows = [head]
    for r in results:
        row = [r.system, f"{r.wall_s:.2f}", f"{r.useful_tok_s:.1f}", f"{r.req_s:.2f}",
               f"{r.padding_waste:.1%}"]
        row += [f"{r.useful_tok_s / b.useful_tok_s:.2f}" if b.useful_tok_s else "-" for b in baselines]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON, creating parent folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path
