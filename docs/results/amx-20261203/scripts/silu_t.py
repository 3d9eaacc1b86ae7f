# SiLU-and-mul at 2048 x 3072 bfloat16 with its input in cache and out of it (run from the repository root)
import sys, time, torch
sys.path.insert(0, ".")
from kernels.cpu_extension import load_extension
ext = load_extension()
torch.set_num_threads(2)
for rows in (16, 128, 2048):
    xs = [torch.randn(rows, 3072).bfloat16() for _ in range(8)]
    for _ in range(3): ext.silu_and_mul(xs[0])
    best_hot = min((lambda t: (ext.silu_and_mul(xs[0]), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(30))
    flush = torch.empty(64 << 20, dtype=torch.float32)
    cold = []
    for i in range(10):
        flush.add_(1)
        t = time.perf_counter(); ext.silu_and_mul(xs[i % 8]); cold.append(time.perf_counter() - t)
    print(f"rows {rows}: hot {best_hot*1e3:.3f} ms, cold best {min(cold)*1e3:.3f} ms", flush=True)
