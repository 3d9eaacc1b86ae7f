"""How the check's sweeps time kernels: as a decode step's CUDA graph runs them.

A kernel launched from Python costs the host more than a short kernel costs the device (Triton's launcher
with some forty arguments, the output's allocation, the launch config's lookup: tens of microseconds), so
eager launches timed back to back measure the host's pace whenever the device is faster, and a config that
shortens the kernel, or lets it overlap the one before (programmatic dependent launch), shows nothing. A
step's graph replays its kernels back to back with no host in between; `time_captured` times them so, and a
sweep captures a step's worth of launches (one per layer, each over its own layer's weights or KV, which
no cache holds between them)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from workers.cuda_graphs import cuda_capture


def _time_replays(replay: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds per call of a captured graph's `replay` after one to warm up, with CUDA events around them."""
    replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / repeats


def time_captured(fn: Callable[[], list[torch.Tensor]], device: torch.device,
                  repeats: int) -> tuple[float, list[torch.Tensor]]:
    """Seconds per call of `fn` (which returns its outputs), captured in one CUDA graph on a GPU and timed
    over its replays; elsewhere (the CPU's dry run, Triton interpreted: its times mean nothing), one call,
    timed. Returns them with copies of the outputs, as the last replay (or call) left them."""
    if device.type != "cuda":
        start_s = time.perf_counter()
        outs = [o.clone() for o in fn()]
        return time.perf_counter() - start_s, outs
    replay, outs = cuda_capture(fn, None)  # compiled and warmed up off the capture
    return _time_replays(replay, device, repeats), [o.clone() for o in outs]


def max_abs_diff(outs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest absolute difference between two calls' outputs, in float32."""
    return max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, reference, strict=True))
