"""Time of the compiled GEMV over F.linear's on every linear layer of SmolLM2-135M's 30 layers in turn, 2 threads,
median of 7, at 8-64 rows (run from the repository root): where the GEMV stops paying (GEMV_MAX_ROWS)."""
import time, torch, sys
import torch.nn.functional as F
torch.set_num_threads(2)
from kernels.cpu_extension import load_extension
ext = load_extension()
L = 30
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
g = torch.Generator().manual_seed(0)
ws = [[torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in shapes] for _ in range(L)]
def seq(f, a, b):
    for lw in ws:
        for w in lw:
            f(a if w.shape[1] == 576 else b, w)
def med(fn, reps=7):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts)//2]
for rnd in range(2):
    line = ""
    for M in (8, 16, 24, 32, 40, 48, 64):
        a = torch.randn(M, 576).to(torch.bfloat16); b = torch.randn(M, 1536).to(torch.bfloat16)
        seq(F.linear, a, b)
        tg = med(lambda: seq(ext.gemv_bf16, a, b)); tf = med(lambda: seq(F.linear, a, b))
        line += f" M{M} {tg/tf:.2f}"
    print("gemv/F.linear time:" + line, flush=True)
