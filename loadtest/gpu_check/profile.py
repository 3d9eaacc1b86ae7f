"""Where a decode step's time goes: a few decode-only steps of a full batch (eager and with graphs) and of one
request (eager), under torch's profiler. Per step: wall time, the device's busy time (the sum of its kernels
and copies), the number of kernels, and the kernels that take the most time. Informational: it passes when
it measured, and says what to speed up when the throughput targets are missed."""

from __future__ import annotations

import cProfile
import pstats
import time
from collections import defaultdict
from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from loadtest.gpu_check.engines import all_decoding, greedy, make_engine, random_prompts, release_memory, sync
from loadtest.gpu_check.plan import Plan
from workers.engine import Engine
from workers.output_processor import OutputKind

TOP_KERNELS = 12
TOP_FUNCTIONS = 20


def _device_events(prof) -> list:
    """The device's kernels and copies (on the CPU, where there are none: the top-level operators)."""
    events = list(prof.events())
    device = [e for e in events if e.device_type != DeviceType.CPU]
    return device or [e for e in events if e.cpu_parent is None and not e.name.startswith("ProfilerStep")]


def host_profile(engine: Engine, num_steps: int) -> dict:
    """Where the host's time goes in a few more steps (Python's profiler; the device work runs meanwhile and
    shows as the wait for the step's sampled ids): the functions with the most time of their own."""
    walls = []
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(num_steps):
        if not engine.has_unfinished_requests():
            break
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    prof.disable()
    steps = max(len(walls), 1)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own time, cumulative, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:TOP_FUNCTIONS]
    return {"steps": len(walls), "wall_ms_per_step_profiled": 1e3 * sum(walls) / steps,
            "top_own_time": [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": calls / steps,
                              "own_ms_per_step": 1e3 * own / steps, "cumulative_ms_per_step": 1e3 * cum / steps}
                             for (file, line, name), (_, calls, own, cum, _) in rows]}


def profile_steps(plan: Plan, model: str, vocab: int, batch: int, graphs: bool, host: bool = False) -> dict:
    engine = make_engine(plan, model, "bfloat16", plan.device, "triton", graphs, max_num_seqs=max(batch, 8))
    params = greedy(plan.output_len + plan.profiled_steps + plan.host_steps + 4)  # room for every step here
    for i, ids in enumerate(random_prompts(batch, plan.prompt_len, vocab, seed=11)):
        engine.add_request(f"p{i}", None, params, prompt_token_ids=ids, output_kind=OutputKind.FINAL_ONLY)
    warm = 0
    while engine.has_unfinished_requests() and (not all_decoding(engine, batch) or warm < 2):
        warm += all_decoding(engine, batch)
        engine.step()
    if not all_decoding(engine, batch):
        return {"batch": batch, "graphs": graphs, "profiled_steps": 0}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(plan.profiled_steps):
            sync(engine)
            t0 = time.perf_counter()
            engine.step()
            sync(engine)
            walls.append(time.perf_counter() - t0)
    events = _device_events(prof)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by_name[e.name].append(e.time_range.elapsed_us())
    busy_us = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    steps = len(walls)
    result = {"batch": batch, "graphs": graphs, "profiled_steps": steps,
              "wall_ms_per_step": 1e3 * sum(walls) / steps, "device_busy_ms_per_step": busy_us / 1e3 / steps,
              "kernels_per_step": len(events) / steps,
              "top": [{"name": name[:120], "ms_per_step": sum(v) / 1e3 / steps, "calls_per_step": len(v) / steps}
                      for name, v in top]}
    result["device_busy_fraction"] = result["device_busy_ms_per_step"] / result["wall_ms_per_step"]
    if host:
        result["host"] = host_profile(engine, plan.host_steps)
    del engine
    release_memory()
    return result


def decode_profile(plan: Plan, model: str, vocab: int) -> dict:
    runs = [profile_steps(plan, model, vocab, plan.batch, False),
            profile_steps(plan, model, vocab, plan.batch, True, host=True), profile_steps(plan, model, vocab, 1, False)]
    return {"passed": all(r["profiled_steps"] for r in runs), "runs": runs}
