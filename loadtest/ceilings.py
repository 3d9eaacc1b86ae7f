"""The machine's ceilings, measured in the same run as a benchmark so that its results can be read as fractions
of them on any host: the matmul rate at the model's own layer shapes (many rows, the faster of `F.linear` and
oneDNN's packed weights: the compute roofline; one row,
over every layer's own weights: the GEMV view of decode, the faster of `F.linear` and the engine's compiled GEMV),
memory read bandwidth, and the 2048³ bf16 matmul
that earlier notes quote (in float32 on a CPU without a native bfloat16 matmul). A few seconds in all on a small
model."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from loadtest.model_shape import ModelShape
from loadtest.results import loadavg

FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
REFERENCE_SIZE = 2048


@dataclass(slots=True)
class CpuInfo:
    model_name: str
    flags: dict[str, bool]


@dataclass(slots=True)
class Ceilings:
    """Rates are best-of (the machine's ceiling, least disturbed by other load); ``*_median`` beside them."""

    device: str
    dtype: str
    threads: int
    rows: int  # rows of the compute-roofline matmuls
    cpu: CpuInfo
    loadavg: tuple[float, float, float]
    matmul_gflops: dict[str, float]  # per model matmul, at `rows` rows
    matmul_gflops_median: dict[str, float]
    layer_gflops: float  # the decoder layers' matmuls together, weighted by their FLOPs
    lm_head_gflops: float
    gemv_gbs: dict[str, float]  # per model matmul at one row: weight bytes read per second, each layer its own
    # (the faster of `F.linear` and the compiled GEMV the engine runs for this dtype on this CPU, `gemv_kernels`)
    gemv_forward_ms: float  # every matmul of one token's forward pass at one row
    read_gbs: float  # memory read bandwidth with `threads` threads
    read_gbs_median: float
    read_gbs_1_thread: float
    read_gbs_1_thread_median: float
    read_bytes: int
    reference_gflops: float  # REFERENCE_SIZE³ matmul in `reference_dtype`, `threads` threads
    reference_gflops_1_thread: float
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # per model matmul at `rows` rows over weights packed in oneDNN's blocked layout (bfloat16 on a CPU with
    # oneDNN: what the engine's `prepack_weights` reads); `matmul_gflops` is the better of this and F.linear
    matmul_gflops_packed: dict[str, float] = field(default_factory=dict)
    # bfloat16, the same on every host, but float32 on a CPU without oneDNN's bfloat16 path (AVX2 only), whose
    # bfloat16 matmul is a scalar loop: ~0.3 GFLOP/s, a minute a call, on a 2-core Zen 3
    reference_dtype: str = "bfloat16"
    # per model matmul, the implementation behind `gemv_gbs` ("F.linear", "gemv_f32", "gemv_bf16"), and
    # `F.linear`'s own rate where the compiled GEMV ran too
    gemv_kernels: dict[str, str] = field(default_factory=dict)
    gemv_gbs_torch: dict[str, float] = field(default_factory=dict)

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def gemv_tok_s(self) -> float:
        """Tokens per second if a decode step were nothing but the matmuls at one row, each run the faster way
        (`gemv_kernels`)."""
        return 1000.0 / self.gemv_forward_ms if self.gemv_forward_ms > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gemv_tok_s": self.gemv_tok_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Ceilings:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["cpu"] = CpuInfo(**known["cpu"])
        known["loadavg"] = tuple(known["loadavg"])
        return cls(**known)


def cpu_info() -> CpuInfo:
    """``lscpu``'s model name and the instruction-set flags that decide bf16 matmul speed (/proc/cpuinfo when
    lscpu is missing)."""
    text = ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        pass
    name = re.search(r"^Model name:\s*(.+)$", text, re.M)
    flags = re.search(r"^Flags:\s*(.+)$", text, re.M)
    if not (name and flags):
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                text = f.read()
        except OSError:
            text = ""
        name = name or re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        flags = flags or re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    return CpuInfo(model_name=name.group(1).strip() if name else "unknown",
                   flags={f: f in have for f in FLAGS_OF_INTEREST})


def _times(fn: Callable[[], Any], sync: Callable[[], None], min_reps: int = 3, max_reps: int = 20,
           min_seconds: float = 0.1) -> list[float]:
    """Seconds per call of ``fn`` after one warm-up call: at least ``min_reps`` calls, more until ``min_seconds``."""
    fn()
    sync()
    times: list[float] = []
    while len(times) < min_reps or (sum(times) < min_seconds and len(times) < max_reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


# Memory reads are sampled for a second: on a shared host a neighbour's burst halved a 0.1 s sample's best (21
# against 51 GB/s minutes apart), and the best of a longer window is the ceiling a run can reach.
_READ_REPS = dict(min_reps=5, max_reps=200, min_seconds=1.0)
# The compute-roofline matmuls likewise, half a second each: a 0.1 s sample once put the layer shapes at 217
# GFLOP/s in a run between two that measured 436 (docs/results/zen4-20261204b/side-first/engine-burst.log), which
# would have credited that run with 1.33 of its compute roofline.
_MATMUL_REPS = dict(min_reps=3, max_reps=1000, min_seconds=0.5)


def _rate(work: float, times: list[float]) -> tuple[float, float]:
    """(best, median) of ``work / seconds``."""
    return work / min(times), work / statistics.median(times)


class _Threads:
    """torch's intra-op thread count set for a block, then restored."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        import torch

        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.set_num_threads(self.before)


def measure_ceilings(shape: ModelShape, threads: int | None = None, dtype: str = "bfloat16", rows: int = 512,
                     device: str = "cpu", read_bytes: int = 256 * 2**20,
                     reference_size: int = REFERENCE_SIZE) -> Ceilings:
    """Measure every ceiling for ``shape`` with ``threads`` torch threads (default: all cores). ``rows`` is the
    token count of the compute-roofline matmuls; ``read_bytes`` the size of the bandwidth buffer (well past the
    last-level cache)."""
    import torch
    import torch.nn.functional as F

    from kernels.cpu_extension import onednn_bf16
    from kernels.layer_ops import linear_packed, packable

    if rows < 1 or read_bytes < 1 or reference_size < 1:
        raise ValueError("rows, read_bytes and reference_size must be positive")
    threads = threads or os.cpu_count() or 1
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"ceilings measure bfloat16, float16 or float32 matmuls, not {dtype!r}")
    on_cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    start = time.perf_counter()

    def uniform(*size: int, dt: torch.dtype = torch_dtype) -> torch.Tensor:
        return torch.empty(*size, dtype=dt, device=device).uniform_(-0.05, 0.05)

    with torch.inference_mode(), _Threads(threads):
        best, median, packed = {}, {}, {}
        for m in shape.matmuls:
            x, w = uniform(rows, m.in_features), uniform(m.out_features, m.in_features)
            best[m.name], median[m.name] = (r / 1e9 for r in _rate(rows * m.flops_per_row,
                                                                   _times(lambda: F.linear(x, w), sync, **_MATMUL_REPS)))
            if not on_cuda and packable(w):
                p = torch.ops.mkldnn._reorder_linear_weight(w, None)
                rate, rate_median = (r / 1e9 for r in _rate(rows * m.flops_per_row,
                                                            _times(lambda: linear_packed(x, p, None), sync,
                                                                   **_MATMUL_REPS)))
                packed[m.name] = rate
                if rate > best[m.name]:
                    best[m.name], median[m.name] = rate, rate_median
                del p
        layer_flops = sum(m.flops_per_row * m.per_token for m in shape.layer_matmuls)
        layer_seconds = sum(m.flops_per_row * m.per_token / (best[m.name] * 1e9) for m in shape.layer_matmuls)
        gemv_gbs, forward_s, gemv_kernels, gemv_torch = _gemv(shape, uniform, sync, torch_dtype,
                                                              _gemv_kernels(torch_dtype, on_cuda))
        reference_dtype = torch.bfloat16 if on_cuda or onednn_bf16() else torch.float32
        reference_a, reference_b = (uniform(reference_size, reference_size, dt=reference_dtype) for _ in range(2))
        reference_flops = 2 * reference_size**3
        reference = _rate(reference_flops, _times(lambda: reference_a @ reference_b, sync, max_reps=5))[0] / 1e9
        buffer = torch.ones(max(1, read_bytes // 4), dtype=torch.float32, device=device)
        nbytes = buffer.numel() * 4
        read, read_median = (r / 1e9 for r in _rate(nbytes, _times(buffer.sum, sync, **_READ_REPS)))
    with torch.inference_mode(), _Threads(1):
        read_1, read_1_median = (r / 1e9 for r in _rate(nbytes, _times(buffer.sum, sync, **_READ_REPS)))
        reference_1 = _rate(reference_flops, _times(lambda: reference_a @ reference_b, sync, min_reps=2,
                                                    max_reps=3))[0] / 1e9
    del buffer, reference_a, reference_b
    notes = ["CUDA: the one-thread numbers still run on the GPU"] if on_cuda else []
    return Ceilings(device=device, dtype=dtype, threads=threads, rows=rows, cpu=cpu_info(), loadavg=loadavg(),
                    matmul_gflops=best, matmul_gflops_median=median, layer_gflops=layer_flops / layer_seconds / 1e9,
                    lm_head_gflops=best["lm_head"], gemv_gbs=gemv_gbs, gemv_forward_ms=forward_s * 1000,
                    read_gbs=read, read_gbs_median=read_median, read_gbs_1_thread=read_1,
                    read_gbs_1_thread_median=read_1_median, read_bytes=nbytes, reference_gflops=reference,
                    reference_gflops_1_thread=reference_1, seconds=time.perf_counter() - start, notes=notes,
                    matmul_gflops_packed=packed, reference_dtype=str(reference_dtype).removeprefix("torch."),
                    gemv_kernels=gemv_kernels, gemv_gbs_torch=gemv_torch)


def _gemv_kernels(torch_dtype: Any, on_cuda: bool) -> dict[str, Callable[..., Any]]:
    """The ways to run one row through a matmul that the engine may take: `F.linear`, and on a CPU the compiled
    GEMV for the dtype where the extension builds (`gemv_f32` for float32; `gemv_bf16` for bfloat16 where it
    was compiled with AVX512-BF16)."""
    import torch
    import torch.nn.functional as F

    kernels: dict[str, Callable[..., Any]] = {"F.linear": F.linear}
    if on_cuda:
        return kernels
    try:
        from kernels.cpu_extension import load_extension

        ext = load_extension()
    except Exception:  # no compiler here: torch's own is all the engine has too
        return kernels
    if torch_dtype == torch.float32:
        kernels["gemv_f32"] = ext.gemv_f32
    elif torch_dtype == torch.bfloat16 and ext.has_avx512_bf16():
        kernels["gemv_bf16"] = ext.gemv_bf16
    return kernels


def _gemv(shape: ModelShape, uniform: Callable[..., Any], sync: Callable[[], None], torch_dtype: Any,
          kernels: dict[str, Callable[..., Any]],
          passes: int = 3) -> tuple[dict[str, float], float, dict[str, str], dict[str, float]]:
    """One row through each matmul, every layer with its own weights (as in the model, so they stream from
    memory rather than sit in cache), by each of `kernels` (a name refusing the shape is left out): weight GB/s
    per matmul by the fastest, seconds for all of them (one decode token), which kernel that was per matmul,
    and `F.linear`'s GB/s where another kernel ran too. Each call is timed alone and its best over ``passes``
    kept, so a pass that another process interrupts does not count."""
    import torch

    element = torch.empty((), dtype=torch_dtype).element_size()
    gbs: dict[str, float] = {}
    torch_gbs: dict[str, float] = {}
    chosen: dict[str, str] = {}
    forward_s = 0.0
    for m in shape.matmuls:
        x = uniform(1, m.in_features)
        weights = [uniform(m.out_features, m.in_features) for _ in range(m.per_token)]
        seconds_by: dict[str, float] = {}
        for name, kernel in kernels.items():
            best = [float("inf")] * len(weights)
            try:
                for _ in range(passes + 1):  # the first pass warms up
                    for i, w in enumerate(weights):
                        start = time.perf_counter()
                        kernel(x, w)
                        sync()
                        best[i] = min(best[i], time.perf_counter() - start)
            except RuntimeError:
                if name == "F.linear":
                    raise
                continue  # a compiled kernel that does not take this shape
            seconds_by[name] = sum(best)
        name = min(seconds_by, key=seconds_by.__getitem__)
        weight_bytes = m.params * m.per_token * element
        gbs[m.name], chosen[m.name] = weight_bytes / seconds_by[name] / 1e9, name
        if len(seconds_by) > 1:
            torch_gbs[m.name] = weight_bytes / seconds_by["F.linear"] / 1e9
        forward_s += seconds_by[name]
        del weights
    return gbs, forward_s, chosen, torch_gbs
