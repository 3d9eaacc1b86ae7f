# oneDNN's packed linear over the 30 layers' weights, 1 vs 2 threads, GFLOP/s at decode row counts
import time, torch
from kernels.layer_ops import linear_packed
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
g = torch.Generator().manual_seed(0)
ws = [[torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16), None) for n, k in shapes] for _ in range(30)]
flop_row = 2 * sum(n * k for n, k in shapes) * 30
for th in (1, 2, 1, 2):
    torch.set_num_threads(th); out = []
    for m in (16, 32, 64, 128, 256):
        a = torch.randn(m, 576).to(torch.bfloat16); b = torch.randn(m, 1536).to(torch.bfloat16)
        f = lambda: [linear_packed(a if k == 576 else b, w, None) for lw in ws for w, (_, k) in zip(lw, shapes)]
        f(); ts = []
        for _ in range(5):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        out.append(f"{m}:{m * flop_row / sorted(ts)[2] / 1e9:.0f}")
    print(th, "threads GFLOP/s", " ".join(out))
