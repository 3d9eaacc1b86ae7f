"""Whether kvrelay's compiled CPU kernels (`kernels/cpu_extension.py`) build on this machine, so that the
tests that need them skip, saying why, where there is no C++ compiler or ninja."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_extension import load_extension


def _build_error() -> str | None:
    try:
        load_extension()
    except Exception as e:  # whatever the compiler, ninja or the linker reported; its last line says what failed
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"
    return None


BUILD_ERROR = _build_error()
COMPILED = BUILD_ERROR is None
SKIP_REASON = f"the compiled CPU kernels do not build here (they need a C++ compiler and ninja): {BUILD_ERROR}"
needs_compiled_kernels = pytest.mark.skipif(not COMPILED, reason=SKIP_REASON)


def within_one_bf16_step(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """`y` as a compiled bfloat16 linear layer's `x @ w.T + b`: each value at most one bfloat16 step, plus the
    worst-case error of float32 sums of its K products (K * 2**-24 * the sum of their magnitudes), from the
    exact result (float64 sums of the exact products); at least 99% are its correctly rounded value."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    magnitudes = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    step = torch.ldexp(torch.ones_like(exact), torch.frexp(exact)[1] - 8)
    assert ((y.double() - exact).abs() <= step + x.shape[1] * 2.0 ** -24 * magnitudes).all()
    assert (y != exact.to(torch.bfloat16)).double().mean() < 0.01


def took_torch_linear(fn) -> bool:
    """Whether `fn` ran torch's linear (the profiler records aten::linear; the compiled GEMVs do not call it)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.key == "aten::linear" for e in prof.key_averages())
