# F.linear at one of SmolLM2-135M's shapes (gate_up's half: 1536 x 576) by row count, bfloat16 against float32,
# then the 2048^3 reference matmul; torch 2.13 CPU, 2 threads. Run with .venv/bin/python.
import time

import torch
import torch.nn.functional as F

print(torch.ops.mkldnn._is_mkldnn_bf16_supported())
w = torch.randn(1536, 576).bfloat16()
for rows in (1, 4, 32, 256):
    x = torch.randn(rows, 576).bfloat16()
    for dt in (torch.bfloat16, torch.float32):
        xx, ww = x.to(dt), w.to(dt)
        F.linear(xx, ww)
        t = time.perf_counter()
        for _ in range(50):
            F.linear(xx, ww)
        print(rows, dt, (time.perf_counter() - t) / 50 * 1e6, 'us')
for dt in (torch.bfloat16, torch.float32):
    a = torch.randn(2048, 2048).to(dt)
    b = torch.randn(2048, 2048).to(dt)
    a @ b
    t = time.perf_counter()
    a @ b
    d = time.perf_counter() - t
    print(dt, d, 2 * 2048**3 / d / 1e9, 'GFLOP/s')
