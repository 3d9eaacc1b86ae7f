"""Result record of one offline system run, and the run metadata (git commit, load average) and JSON
writing that every result file shares."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
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


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON, creating parent folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


class Timed:
    """Wraps a callable and adds up the seconds spent in it, the calling thread's CPU seconds in it (less than
    the seconds when the thread waited off the CPU: descheduled, or asleep in a call), and the calls."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.cpu_seconds, self.calls = fn, 0.0, 0.0, 0

    def __call__(self, *args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu
            self.calls += 1
