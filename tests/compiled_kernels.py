"""Whether kvrelay's compiled CPU kernels (`kernels/cpu_extension.py`) build on this machine, so that the
tests that need them skip, saying why, where there is no C++ compiler or ninja."""

from __future__ import annotations

import pytest

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
