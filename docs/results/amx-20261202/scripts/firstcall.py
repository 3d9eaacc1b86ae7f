# oneDNN's packed linear: first call at a new row count vs later calls (primitive creation, AMX JIT)
import time, torch
torch.set_num_threads(2)
from kernels.layer_ops import linear_packed
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
g = torch.Generator().manual_seed(0)
ws = [torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16), None) for n, k in shapes]
for m in (9, 10, 23, 37, 64, 100, 129, 200, 255):
    for (n, k), w in zip(shapes, ws):
        x = torch.randn(m, k).to(torch.bfloat16)
        t = time.perf_counter(); linear_packed(x, w, None); first = time.perf_counter() - t
        ts = []
        for _ in range(5):
            t = time.perf_counter(); linear_packed(x, w, None); ts.append(time.perf_counter() - t)
        print(f"m={m:3d} {n}x{k}: first {first*1e3:7.2f} ms, then {sorted(ts)[2]*1e3:6.2f} ms")
