"""Transparent huge pages for the paged KV cache on the CPU.

The decode attention reads each request's blocks from wherever the pool put them, so with 4 KiB pages
nearly every block costs a TLB miss, and in a virtual machine a miss walks two page tables. Backed by
2 MiB pages, the same kernel swept over 30 layers' caches ran ~15% faster at 40 and 200 requests on a
2-core Intel guest (`docs/benchmarks.md`). Linux gives them to a range marked `MADV_HUGEPAGE` when its
transparent huge pages are set to `madvise` (the usual default) or `always`, but only as pages are first
touched: memory that malloc hands back from its heap may be touched already. So the cache gets a mapping
of its own."""

from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE_PAGE = 2 * 2**20


def zeros_on_huge_pages(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros(*shape)`; on the CPU under Linux, in an anonymous mapping of its own advised for huge
    pages, all touched before this returns (as `torch.zeros` touches its memory). The tensor keeps the
    mapping alive."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if (torch.device(device).type != "cpu" or not sys.platform.startswith("linux") or nbytes < HUGE_PAGE
            or not hasattr(mmap, "MADV_HUGEPAGE")):
        return torch.zeros(*shape, dtype=dtype, device=device)
    # private: a shared mapping would get huge pages only as /sys/kernel/mm/transparent_hugepage/shmem_enabled says
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: small pages, as torch would give
        pass
    t = torch.frombuffer(buf, dtype=dtype, count=numel).view(*shape)
    return t.zero_()  # fresh anonymous pages read as zeros already; this faults them all in now
