"""Bounds on oneDNN's per-shape caches, so an engine's memory stops growing with the batch sizes it has seen.

On the CPU, bf16 `F.linear` runs through oneDNN (via ideep), which compiles and caches one primitive per
input shape in two LRU caches of 1,024 entries each (ideep's `LRU_CACHE_CAPACITY`, oneDNN's
`ONEDNN_PRIMITIVE_CACHE_CAPACITY`). Every step's token count is a new row count for each weight, so a
serving engine fills both caches slowly (~0.7 MiB per primitive: +870 MiB over 564 distinct step sizes
of SmolLM2-135M's shapes), and the replica's RSS climbs for thousands of requests. With 64 entries the
same steps grow RSS by ~100 MiB, and compiling a primitive costs far less than the matmul it runs."""

from __future__ import annotations

import os

CACHE_CAPACITY = 64
CACHE_ENV_VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = CACHE_CAPACITY) -> None:
    """Cap both caches unless the environment already sets them. oneDNN reads them at its first primitive,
    so call this before the process runs its first matmul (later calls change nothing)."""
    for name in CACHE_ENV_VARS:
        os.environ.setdefault(name, str(capacity))
