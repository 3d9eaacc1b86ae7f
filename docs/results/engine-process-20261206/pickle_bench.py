"""Pickling one batch-256 step's delta outputs (one token each), as they cross processes every step.
`workers.engine` is imported first and the heap frozen, as a Serve replica's is once its code is built
(`RAY_SERVE_FREEZE_GC_ON_STARTUP`), so the collector's passes while unpickling see what a replica's see.

    PYTHONPATH=. .venv/bin/python docs/results/engine-process-20261206/pickle_bench.py"""

import gc
import pickle
import time

import workers.engine  # noqa: F401
from workers.outputs import CompletionOutput, RequestOutput

gc.collect()
gc.freeze()
outs = [RequestOutput(f"cmpl-{i:032x}-0", None, [], [CompletionOutput(0, " word", [12345])], False, 0,
                      {"arrival_time": 1.0, "first_token_time": 2.0}) for i in range(256)]
for _ in range(3):
    start = time.perf_counter()
    for _ in range(200):
        data = pickle.dumps(outs, protocol=5)
    dumps = (time.perf_counter() - start) / 200
    start = time.perf_counter()
    for _ in range(200):
        pickle.loads(data)
    loads = (time.perf_counter() - start) / 200
    print(f"{len(data)} bytes, dumps {dumps * 1e3:.3f} ms, loads {loads * 1e3:.3f} ms")
