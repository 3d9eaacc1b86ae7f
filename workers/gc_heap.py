"""The Python heap a process holds once its engine is built, frozen out of the garbage collector's passes.

CPython's collector walks every tracked object of a generation on each of its passes; a full pass over the
~300,000 objects that torch, transformers and an engine leave alive took ~150-200 ms on a 2-core Zen 3 host,
and the engine thread (a GPU's next step with it) stands still meanwhile. The objects alive once an engine
is built live as long as the process, so they are collected once and moved to the permanent generation
(`gc.freeze`), as vLLM does after its warm-up and Ray Serve at the end of a replica's start: later passes
walk only what the requests made. Frozen objects are still freed when their last reference goes (an engine
dropped in-process included); only a reference cycle among them is never collected.
`KVRELAY_FREEZE_GC=0` leaves the heap as it is."""

from __future__ import annotations

import gc
import os

ENV = "KVRELAY_FREEZE_GC"


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive; returns how many are frozen in all (0 where turned off)."""
    if os.environ.get(ENV, "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
