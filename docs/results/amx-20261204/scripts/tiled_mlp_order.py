# tiled_mlp.py's functions in another order: all rows four times, tiles of 1152 once, all rows twice. Run from
# the repository root, with and without MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824.
import runpy, sys
sys.argv = ["x"]
src = open("docs/results/amx-20261204/scripts/tiled_mlp.py").read().split("for rnd in range(3):")[0]
exec(src)
import time
for rnd in range(4):
    print(f"all rows {bench(lambda: full(x)):.1f} ms", flush=True)
print(f"tiles of 1152 {bench(lambda: tiled(x, 1152)):.1f} ms", flush=True)
for rnd in range(2):
    print(f"all rows {bench(lambda: full(x)):.1f} ms", flush=True)
