# Tried on 2026-12-07 as workers/malloc_reuse.py and not kept (docs/benchmarks.md, "The sampler on the CPU").
"""Large host allocations reused by glibc's malloc instead of mapped afresh, for an engine on the CPU.

glibc serves an allocation above its mmap threshold (at most 32 MiB by default) with a mapping of its own and
unmaps it on free, so the next one starts on fresh pages, each a page fault on first touch (~1.4 us per 4 KiB
page on a 2-core EPYC guest). A batch-256 step's float32 logits over SmolLM2's 49,152-token vocabulary are 50
MB: the LM head's output, the sampler's float32 copy under penalties, the softmax and cumulative sums of a
sampled batch each took ~12,000 faults, ~17 ms, every step (a 50 MB copy: 20.9 ms fresh, 3.9 reused). With
the thresholds raised the freed blocks stay in malloc's heap and the next step's come back warm. vLLM's CPU
backend gets the same from tcmalloc, which its docs have users preload; here it is two `mallopt` calls.

A thread's own arena holds blocks of up to 64 MiB; larger ones are still mapped per allocation. Memory freed
stays with the process up to `TRIM_THRESHOLD` (the high-water mark of the step's temporaries, as with
tcmalloc). Only for an engine on the CPU: a GPU's host allocations are staging copies that should go back.
`KVRELAY_MALLOC_REUSE=0`, or either `MALLOC_*_THRESHOLD_` variable set, leaves malloc as it is."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ENV = "KVRELAY_MALLOC_REUSE"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 2**30  # allocations at least this large are still mapped apart
TRIM_THRESHOLD = 2**30  # free memory at the heap's top kept for reuse, at most
_applied: bool | None = None


def reuse_large_allocations() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); whether they are raised."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if (os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux")
            or any(f"MALLOC_{k}_THRESHOLD_" in os.environ for k in ("MMAP", "TRIM"))):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):  # glibc's (musl's has no mallopt)
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the trim threshold first: raising the mmap threshold alone lets glibc trim each freed block at once
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
