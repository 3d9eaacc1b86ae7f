"""The GEMV's rate with weights that stay in cache (one layer's four matrices, called 30 times) against
every layer's weights from memory, 2 threads: is it compute or memory that limits it past a few rows?"""
import time, torch
torch.set_num_threads(2)
from kernels.cpu_extension import load_extension
ext = load_extension()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
g = torch.Generator().manual_seed(0)
all_layers = [[torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in shapes] for _ in range(30)]
one = [all_layers[0]] * 30
flop_row = 2 * sum(n * k for n, k in shapes) * 30
def seq(ws, a, b):
    for lw in ws:
        for w in lw:
            ext.gemv_bf16(a if w.shape[1] == 576 else b, w)
def med(fn, reps=9):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2]
for rnd in range(2):
    for name, ws in (("from memory", all_layers), ("in cache", one)):
        line = f"{name:12s}"
        for M in (1, 4, 8, 16, 32):
            a = torch.randn(M, 576).to(torch.bfloat16); b = torch.randn(M, 1536).to(torch.bfloat16)
            t = med(lambda: seq(ws, a, b))
            line += f" M{M} {t*1e3:5.1f} ms {flop_row*M/t/1e9:4.0f} GF/s |"
        print(line, flush=True)
