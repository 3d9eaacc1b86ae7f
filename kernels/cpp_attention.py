"""The CPU backend with a compiled decode kernel: single-token queries read K/V straight from the paged
cache through the block table (no gather copy), one task per (request, KV head). Chunks keep the torch
path (masked SDPA), whose GEMMs suit many queries per request.

The C++ source is built once with torch's extension loader (needs a C++ compiler and ninja) and cached
under torch's extensions folder; `get_attention_backend("auto")` falls back to the torch backend when
the build is unavailable."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from kernels.cpu_attention import TorchPagedAttention

_SOURCE = Path(__file__).with_name("csrc_paged_decode.cpp")
_NAME = "kvrelay_paged_decode"
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
    return load(name=_NAME, sources=[str(_SOURCE)], verbose=False,
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"], extra_ldflags=["-fopenmp"])


class CppPagedAttention(TorchPagedAttention):
    name = "cpp"

    def __init__(self) -> None:
        self._ext = load_extension()

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, x: dict, scale: float) -> torch.Tensor:
        return self._ext.paged_decode_attention(q, k_cache, v_cache, x["dec_tables"], x["dec_context_lens"], scale)
