"""Bench-only: with KVRELAY_STANDIN_MS set, every Engine built in this process gets a GPU-like forward:
it sleeps that long (the GIL released, as a thread waiting on a device) and returns fixed logits over a
512-token slice (argmax: ids 300-511); it leaves /tmp/standin-<pid>, to tell that a replica took it."""
import os
import sys

_MS = os.environ.get("KVRELAY_STANDIN_MS")
if _MS:
    import builtins
    _real_import = builtins.__import__
    _done = []

    def _hook(name, *a, **k):
        mod = _real_import(name, *a, **k)
        if not _done and "workers.engine" in sys.modules:
            eng = sys.modules["workers.engine"]
            if hasattr(eng, "Engine"):
                _done.append(1)
                builtins.__import__ = _real_import
                _patch(eng.Engine)
        return mod

    def _patch(Engine):
        import time
        import torch
        init = Engine.__init__
        sleep_s = float(_MS) / 1000

        def __init__(self, *a, **k):
            init(self, *a, **k)
            logits = torch.zeros(1024, 512)
            rows = torch.arange(1024)
            logits[rows, 300 + rows * 7 % 212] = 10.0

            def forward(input_ids, positions, meta, logits_indices):
                time.sleep(sleep_s)
                return logits[:logits_indices.shape[0]]

            self.runner._forward = forward
            open(f"/tmp/standin-{os.getpid()}", "w").close()

        Engine.__init__ = __init__

    builtins.__import__ = _hook
