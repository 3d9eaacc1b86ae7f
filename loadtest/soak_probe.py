"""What the soak reads from the server side: the engine's gauges and counters from `/metrics`, and the
resident memory of the engine replica processes (found by the process title Ray gives Serve replicas,
`ray::ServeReplica:<app>:<deployment>`, then `VmRSS` from /proc), so it works for a server on this host
whether the soak started it or not."""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ENGINE_DEPLOYMENTS = ("EngineWorker", "PrefillWorker")
INGRESS_DEPLOYMENT = "OpenAIIngress"  # runs the engine when the app has no engine deployment (engine_in_ingress)
REPLICA_TITLE = re.compile(r"ServeReplica:([^:\s]+):(\w+)")


@dataclass
class ServerState:
    """The engine gauges summed over replicas (KV usage: the fullest replica), and request counters."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    preemptions: float = 0.0
    finished: dict[str, float] = field(default_factory=dict)  # sequences by finish reason

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.kv_usage == 0


def metrics_url(url: str) -> str:
    base = url.rstrip("/")
    return (base[: -len("/v1")] if base.endswith("/v1") else base) + "/metrics"


def parse_server_state(text: str) -> ServerState | None:
    """The engine state in a `/metrics` exposition; None when it has no `kvrelay:` engine gauges."""
    state, seen = ServerState(), False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, sample.value
            if name == "kvrelay:num_requests_running":
                state.running += value
            elif name == "kvrelay:num_requests_waiting":
                state.waiting += value
            elif name == "kvrelay:kv_cache_usage_perc":
                state.kv_usage, seen = max(state.kv_usage, value), True
            elif name == "kvrelay:num_preemptions_total":
                state.preemptions += value
            elif name == "kvrelay:request_success_total":
                reason = sample.labels.get("finished_reason", "?")
                state.finished[reason] = state.finished.get(reason, 0.0) + value
    return state if seen else None


def scrape(url: str, timeout_s: float = 10.0) -> ServerState | None:
    """The server's engine state, or None when `/metrics` is missing or has no engine gauges."""
    try:
        with urllib.request.urlopen(metrics_url(url), timeout=timeout_s) as resp:
            return parse_server_state(resp.read().decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        return None


def wait_idle(url: str, timeout_s: float, poll_s: float = 0.5) -> tuple[ServerState | None, float]:
    """Poll `/metrics` until the engine is idle (nothing running or waiting, no KV blocks in use) or
    `timeout_s` passes; the last state seen and the seconds waited."""
    start = time.monotonic()
    while True:
        state = scrape(url)
        waited = time.monotonic() - start
        if state is None or state.idle or waited >= timeout_s:
            return state, waited
        time.sleep(poll_s)


def replica_of(title: str) -> tuple[str, str] | None:
    """(app, deployment) of a Serve replica's process title, which reads `ray::ServeReplica:<app>:<deployment>`
    when idle and gains the actor's name before it, or the running method after it, while busy."""
    match = REPLICA_TITLE.search(title) if title.startswith("ray::") else None
    return (match.group(1), match.group(2)) if match else None


def _parent(pid: int, proc: Path) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _descends_from(pid: int, ancestor: int, proc: Path) -> bool:
    seen = set()
    while pid not in seen and pid > 1:
        if pid == ancestor:
            return True
        seen.add(pid)
        pid = _parent(pid, proc) or 0
    return False


def engine_replica_pids(app: str | None = None, ancestor: int | None = None,
                        proc: Path = Path("/proc")) -> dict[int, str]:
    """Engine replica processes on this host ({pid: title}): of Serve app `app` (or any app), and with
    `ancestor`, only its descendants (the replicas of a Ray cluster this process started). An app with no
    engine deployment here runs its engine in its ingress's replicas (`engine_in_ingress`): those count."""
    engines: dict[int, tuple[str, str]] = {}
    ingresses: dict[int, tuple[str, str]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
        except OSError:
            continue
        replica = replica_of(title)
        if replica is None or app not in (None, replica[0]):
            continue
        kind = engines if replica[1] in ENGINE_DEPLOYMENTS else ingresses if replica[1] == INGRESS_DEPLOYMENT else None
        if kind is not None and (ancestor is None or _descends_from(int(entry.name), ancestor, proc)):
            kind[int(entry.name)] = (replica[0], title)
    with_engines = {a for a, _ in engines.values()}
    found = {pid: title for pid, (_, title) in engines.items()}
    found.update({pid: title for pid, (a, title) in ingresses.items() if a not in with_engines})
    return found


def rss_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """`VmRSS` of process `pid` in bytes, or None when it is gone."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pids: list[int], proc: Path = Path("/proc")) -> float | None:
    """User + system CPU seconds the processes have used, or None when any of them is gone."""
    total = 0.0
    for pid in pids:
        try:
            stat = (proc / str(pid) / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None
    return total if pids else None


def total_rss(pids: list[int]) -> int | None:
    """The replicas' RSS summed, or None when any of them is gone (a restarted replica is a new process)."""
    values = [rss_bytes(p) for p in pids]
    return None if not values or any(v is None for v in values) else sum(v for v in values if v is not None)


class RssSampler:
    """Samples the replicas' total RSS every `interval_s` while the load runs: [(seconds, bytes), ...]."""

    def __init__(self, pids: list[int], interval_s: float) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.samples: list[tuple[float, int | None]] = []
        self._task: asyncio.Task | None = None
        self._start = 0.0

    async def _run(self) -> None:
        while True:
            self.samples.append((round(time.monotonic() - self._start, 1), total_rss(self.pids)))
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._start = time.monotonic()
        if self.pids:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
