"""Builds and loads kvrelay's compiled CPU kernels (paged attention, the fused layer ops, bfloat16 and float32
GEMVs, the AMX linear layer for decode steps, the decoder stack of a decode step).

The C++ sources are built once with torch's extension loader (needs a C++ compiler and ninja) and
cached under torch's extensions folder, one build folder per set of sources, flags and torch install.
Callers fall back to plain torch when the build is unavailable."""

from __future__ import annotations

import fcntl
import functools
import hashlib
from pathlib import Path

import torch

_HERE = Path(__file__).parent
SOURCES = [_HERE / f"csrc_{name}.cpp" for name in ("bindings", "paged_decode", "attention_bf16", "layer_ops",
                                                         "gemv_bf16", "gemv_f32", "amx_linear", "decode_layers")]
_NAME = "kvrelay_cpu_kernels"
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]


def _sources() -> list[Path]:
    """The sources by their real paths: a checkout or virtualenv reached through a symlink (a git worktree
    that links the main checkout's .venv, whose console scripts name the real interpreter) is the same
    one, not a second build inside the first server a test starts, while the test waits."""
    return [source.resolve() for source in SOURCES]


def _build_directory() -> Path:
    """A build folder named by the sources' paths and contents, the flags and the torch install. ninja
    rebuilds everything when a source path or flag changes, so two checkouts sharing one folder would
    rebuild it in turn, and a replica restarting after the other one ran would spend minutes compiling
    (holding the lock) before it could serve."""
    from torch.utils.cpp_extension import _get_build_directory

    torch_install = Path(torch.__file__).resolve()
    digest = hashlib.sha256(f"{torch_install} {torch.__version__} {_CFLAGS} {_LDFLAGS}".encode())
    for source in _sources():
        digest.update(str(source).encode())
        digest.update(source.read_bytes())
    return Path(_get_build_directory(f"{_NAME}-{digest.hexdigest()[:16]}", verbose=False))


@functools.cache
def load_extension():
    """Build (once) and load the extension. torch's loader takes a lock file for every load and waits
    forever if a process died holding it (a replica killed while it compiled, say). Loads here first
    take an `flock`, which the kernel releases when its holder dies: whoever holds it can delete torch's
    lock file, since a live holder of that file would hold the flock too."""
    from torch.utils.cpp_extension import load

    build_directory = _build_directory()
    with open(build_directory / "load.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_directory / "lock").unlink(missing_ok=True)
        return load(name=_NAME, sources=[str(s) for s in _sources()], verbose=False, extra_cflags=_CFLAGS,
                    extra_ldflags=_LDFLAGS, build_directory=str(build_directory))


def has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles that oneDNN's bfloat16 matmuls and torch's flash attention use (torch's
    own check)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(check()) if check is not None else False
    except Exception:
        return False


@functools.cache
def onednn_bf16() -> bool:
    """Whether this torch's oneDNN runs bfloat16 matmuls natively on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT,
    torch's own check). Without it oneDNN refuses to pack a bfloat16 weight, and `F.linear` in bfloat16 falls
    back to a loop that converts each element: on a 2-core AMD Zen 3 (AVX2 only) 7x slower than float32 at 256
    rows (docs/benchmarks.md)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return torch.backends.mkldnn.is_available() and check is not None and bool(check())
    except Exception:
        return False


def require_cpu(*tensors: torch.Tensor) -> None:
    """The compiled kernels read host memory: refuse anything else with an error that says what to use."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the compiled CPU kernels take CPU tensors, got one on {t.device}; on a GPU use "
                             "attention_backend 'triton' (or 'auto')")
