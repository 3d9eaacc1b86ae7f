"""How long a replica's death costs: kill an engine replica's actor (`ray.kill`), keep sending small
requests, and time each phase until one is served again (`kvrelay bench recovery`).

Phases, from the kill: Serve notices (the replica leaves RUNNING), the replacement's process starts,
its constructor runs (imports done, then the model loaded), Serve lists it RUNNING, and the ingress
routes a request to it. The replacement reports its own clock readings (`EngineWorker.startup_times`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

PROBE_BODY = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}


@dataclass(slots=True)
class Probe:
    """One request sent during recovery: when it left and came back (seconds after the kill), and the
    error (the server's message, or why no answer came)."""

    sent_s: float
    done_s: float
    status: int | None
    error: str | None = None


@dataclass
class RecoveryRun:
    """Seconds after the kill at which each phase ended (None: not seen)."""

    served_s: float | None = None
    noticed_s: float | None = None
    process_started_s: float | None = None
    constructor_started_s: float | None = None
    engine_ready_s: float | None = None
    running_s: float | None = None
    probes: list[Probe] = field(default_factory=list)

    @property
    def longest_wait_s(self) -> float:
        """The longest any probe waited for its answer (the silence a client saw)."""
        return max((p.done_s - p.sent_s for p in self.probes), default=0.0)

    def statuses(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for p in self.probes:
            key = str(p.status) if p.status is not None else "no answer"
            counts[key] = counts.get(key, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "longest_wait_s": self.longest_wait_s, "statuses": self.statuses()}


def replica_actor_names(app: str, deployment: str) -> list[str]:
    """Names of the live replica actors of one deployment of one Serve application."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and f"{app}#{deployment}#" in a["name"])


def kill_replica(app: str, deployment: str) -> tuple[str, float]:
    """`ray.kill` one replica actor of the deployment; its name and the wall-clock time of the kill."""
    import ray

    names = replica_actor_names(app, deployment)
    if not names:
        raise RuntimeError(f"no live replica of {app}/{deployment} to kill")
    actor = ray.get_actor(names[0], namespace="serve")
    killed_at = time.time()
    ray.kill(actor, no_restart=True)
    return names[0], killed_at


def _running(app: str, deployment: str) -> int:
    from ray import serve

    application = serve.status().applications.get(app)
    dep = application.deployments.get(deployment) if application else None
    return dep.replica_states.get("RUNNING", 0) if dep else 0


async def _probe(session: aiohttp.ClientSession, url: str, model: str, t0: float, timeout_s: float) -> Probe:
    sent = time.time() - t0
    try:
        async with session.post(f"{url}/v1/completions", json={"model": model, **PROBE_BODY},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            return Probe(sent, time.time() - t0, resp.status, None if resp.status == 200 else _error_message(raw))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Probe(sent, time.time() - t0, None, f"{type(e).__name__}: {e}")


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI-style error body, else the start of the body as text."""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return "not an OpenAI error body: " + raw[:200].decode(errors="replace")


async def _watch_serve(app: str, deployment: str, before: int, run: RecoveryRun, t0: float,
                       stop: asyncio.Event) -> None:
    """Serve's view, polled: when the dead replica left RUNNING, and when RUNNING was back to `before`."""
    while not stop.is_set():
        running = await asyncio.to_thread(_running, app, deployment)
        now = time.time() - t0
        if run.noticed_s is None and running < before:
            run.noticed_s = now
        if run.noticed_s is not None and run.running_s is None and running >= before:
            run.running_s = now
        await asyncio.sleep(0.1)


def engine_deployment(app: str) -> str:
    """The deployment of `app` whose replicas run engines: `EngineWorker`, or the ingress when the engine
    runs in it (`engine_in_ingress`)."""
    from ray import serve

    deployments = serve.status().applications[app].deployments
    return "EngineWorker" if "EngineWorker" in deployments else "OpenAIIngress"


async def measure_recovery(url: str, app: str, model: str, deployment: str | None = None,
                           probe_interval_s: float = 0.5, probe_timeout_s: float = 60.0,
                           limit_s: float = 180.0) -> RecoveryRun:
    """Kill one replica of `deployment` (default: the one running the engine) and send a probe every
    `probe_interval_s` until one gets 200 (then wait for the probes still out), or until `limit_s` (then
    `served_s` stays None). The caller's process must be connected to the app's Ray cluster."""
    deployment = deployment or await asyncio.to_thread(engine_deployment, app)
    before = await asyncio.to_thread(_running, app, deployment)
    _, t0 = kill_replica(app, deployment)
    run = RecoveryRun()
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_serve(app, deployment, before, run, t0, stop))
    pending: set[asyncio.Task] = set()
    async with aiohttp.ClientSession() as session:
        while run.served_s is None and time.time() - t0 < limit_s:
            pending.add(asyncio.create_task(_probe(session, url, model, t0, probe_timeout_s)))
            done, pending = await asyncio.wait(pending, timeout=probe_interval_s)
            for task in done:
                probe = task.result()
                run.probes.append(probe)
                if probe.status == 200 and (run.served_s is None or probe.done_s < run.served_s):
                    run.served_s = probe.done_s
        for task in asyncio.as_completed(pending):
            run.probes.append(await task)
    while run.served_s is not None and run.running_s is None and time.time() - t0 < limit_s:
        await asyncio.sleep(0.1)
    stop.set()
    await watcher
    run.probes.sort(key=lambda p: p.sent_s)
    if run.served_s is not None:
        await _read_startup_times(app, deployment, run, t0)
    return run


async def _read_startup_times(app: str, deployment: str, run: RecoveryRun, t0: float) -> None:
    """The replacement's own clock readings (any replica that started after the kill)."""
    from ray import serve

    from serving.engine_client import awaited

    handle = serve.get_deployment_handle(deployment, app_name=app)
    times = await asyncio.wait_for(awaited(handle.startup_times.remote()), 30)
    if times["process_started"] >= t0 - 1:
        for phase in ("process_started", "constructor_started", "engine_ready"):
            setattr(run, f"{phase}_s", times[phase] - t0)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


PHASES = (("noticed_s", "Serve notices"), ("process_started_s", "new process"),
          ("constructor_started_s", "constructor"), ("engine_ready_s", "engine ready"),
          ("running_s", "RUNNING"), ("served_s", "first 200"), ("longest_wait_s", "longest wait"))


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown table: one row per run (seconds after the kill), then the median."""
    head = "| run | " + " | ".join(label for _, label in PHASES) + " | answers during the gap |"
    rows = [head, "|" + "---|" * (len(PHASES) + 2)]
    for i, r in enumerate(runs, 1):
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
        rows.append(f"| {i} | " + " | ".join(_fmt(r[key]) for key, _ in PHASES) + f" | {statuses} |")
    medians = [statistics.median(r[key] for r in runs if r[key] is not None) if any(r[key] is not None for r in runs)
               else None for key, _ in PHASES]
    rows.append("| median | " + " | ".join(_fmt(m) for m in medians) + " | |")
    return "\n".join(rows)


def run_recovery(args: argparse.Namespace) -> int:
    """`kvrelay bench recovery`: a private cluster, one app, `--rounds` kills; JSON in `--out`."""
    from loadtest.overhead import MODEL_NAME, LocalCluster
    from loadtest.results import git_commit, loadavg, write_json
    from serving.ray_cluster import wait_until_healthy

    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    options = {"kv_cache_memory": "256MiB", **dict(args.option)}
    payload: dict[str, Any] = {"format": "kvrelay-recovery/1", "command": "kvrelay bench " + " ".join(args.argv),
                               "options": options, "git_commit": git_commit(), "loadavg_start": loadavg(), "runs": []}
    with LocalCluster() as cluster:
        url = cluster.deploy("recovery", options)
        for i in range(args.rounds):
            _warm(url, MODEL_NAME)
            run = asyncio.run(measure_recovery(url, "recovery", MODEL_NAME, probe_interval_s=args.probe_interval))
            payload["runs"].append(run.to_dict())
            print(f"round {i + 1}: served {_fmt(run.served_s)} s after the kill", flush=True)
            wait_until_healthy(url, timeout_s=600)
    payload["loadavg_end"] = loadavg()
    path = write_json(args.out / f"recovery-{time.strftime('%Y%m%d-%H%M%S')}.json", payload)
    print(table(payload["runs"]))
    print(f"wrote {path}")
    return 0


def _warm(url: str, model: str) -> None:
    """One served request, so the next round starts from a replica that has answered."""
    async def once() -> int:
        async with aiohttp.ClientSession() as session:
            return (await _probe(session, url, model, time.time(), 120)).status or 0

    status = asyncio.run(once())
    if status != 200:
        raise RuntimeError(f"the app does not serve before the kill (HTTP {status})")


def add_parser(sub: Any, key_value: Any) -> None:
    p = sub.add_parser("recovery", help="kill an engine replica (ray.kill) and time each phase until a request "
                                        "is served again")
    p.add_argument("--rounds", type=int, default=3, help="kills, one after another on the same app")
    p.add_argument("--probe-interval", type=float, default=0.5, help="seconds between probe requests")
    p.add_argument("--option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="engine or serving option of the app (repeatable), e.g. replica_wait_timeout_s=5")
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON result")
