"""Builds and loads kvrelay's compiled CPU kernels (paged decode attention and the fused layer ops).

The C++ sources are built once with torch's extension loader (needs a C++ compiler and ninja) and
cached under torch's extensions folder. Callers fall back to plain torch when the build is unavailable."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

_HERE = Path(__file__).parent
SOURCES = [_HERE / f"csrc_{name}.cpp" for name in ("bindings", "paged_decode", "attention_bf16", "layer_ops")]
_NAME = "kvrelay_cpu_kernels"
# torch's loader takes a lock file for every load and waits forever if a process died holding it (for
# example a server stopped during its first start). A build takes well under this; older locks are dead.
_STALE_LOCK_S = 300


def _remove_stale_lock(lock: Path) -> None:
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass


@functools.cache
def load_extension():
    from torch.utils.cpp_extension import _get_build_directory, load

    _remove_stale_lock(Path(_get_build_directory(_NAME, verbose=False)) / "lock")
    return load(name=_NAME, sources=[str(s) for s in SOURCES], verbose=False,
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"],
                extra_ldflags=["-fopenmp"])


def require_cpu(*tensors: torch.Tensor) -> None:
    """The compiled kernels read host memory: refuse anything else with an error that says what to use."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the compiled CPU kernels take CPU tensors, got one on {t.device}; on a GPU use "
                             "attention_backend 'triton' (or 'auto')")
