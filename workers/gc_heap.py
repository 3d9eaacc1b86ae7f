"""The Python heap of a process that serves, frozen out of the garbage collector's passes once its engine is built.

CPython's collector walks every tracked object of a generation on each of its passes; a full pass over the
~370,000 objects that torch, transformers and an engine leave alive took 158-174 ms on a 2-core Zen 3 host,
and the engine thread (a GPU's next step with it) stands still meanwhile. In a process that exists to serve,
what is alive once the engine is built lives as long as the process, so it is collected once and moved to the
permanent generation (`gc.freeze`): later passes walk only what the requests made. Ray Serve does this at the
end of a replica's start (an engine replica's engine is built by then); vLLM in its engine's processes after
the warm-up. Here it is called where kvrelay owns the process and Serve does not: a tensor-parallel rank (a
Ray actor), and the GPU check's and `host-step`'s engines, which measure an engine as a replica runs it. An
`LLM` in the user's own process freezes nothing: the heap there is the user's.

Frozen objects are still freed when their last reference goes (an engine dropped in-process included); only
a reference cycle among them is never collected. `KVRELAY_FREEZE_GC=0` leaves the heap as it is."""

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
