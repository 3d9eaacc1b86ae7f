"""`propose` per request per step, a history of L tokens growing by one a step (2,000 steps), from the list
(converted whole each step) or from its `TokenArray` (extended by the new token). Random tokens: the search
runs down to 1-grams, its longest path.

    PYTHONPATH=. .venv/bin/python docs/results/ngram-20261206/propose_bench.py"""
import random
import time

from workers.ngram import TokenArray, propose

random.seed(0)
for L in (200, 1000, 4000):
    timings = {}
    for mode in ("list", "array", "list", "array"):
        toks, arr = [random.randrange(49152) for _ in range(L)], TokenArray()
        t = time.perf_counter()
        for _ in range(2000):
            toks.append(random.randrange(49152))
            propose(arr.of(toks) if mode == "array" else toks, 4, 4, 1)
        timings.setdefault(mode, []).append((time.perf_counter() - t) / 2000 * 1e6)
    print(f"history {L}-{L + 2000}: " + ", ".join(f"{m} {' / '.join(f'{v:.1f}' for v in vs)} us"
                                                   for m, vs in timings.items()))
