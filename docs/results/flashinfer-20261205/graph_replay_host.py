"""The host's part of a decode-graph replay (`DecodeGraphs.run`: host buffers filled and padded, the one copy,
the replay) at batch 256, the replayed step a no-op, on the CPU (`eager_capture`): the path the FlashInfer
change touched (a per-step hook, not passed for backends without one). Run from a checkout's root:
    PYTHONPATH=. .venv/bin/python docs/results/flashinfer-20261205/graph_replay_host.py"""
import time

import torch

from kernels.attention import CommonAttentionMetadata
from workers import cuda_graphs
from workers.cuda_graphs import DecodeGraphs, eager_capture

torch.set_num_threads(1)
out = torch.zeros(256, 8)
graphs = DecodeGraphs(lambda ids, pos, meta, rows: out[:ids.shape[0]], lambda *views: views, max_batch=256,
                      max_blocks=64, device=torch.device("cpu"), capture=eager_capture)
n = 250
common = CommonAttentionMetadata(torch.ones(n, dtype=torch.long), torch.arange(n + 1), torch.randint(100, 300, (n,)),
                                 torch.randint(0, 4000, (n, 19)), torch.randint(0, 60000, (n,)), 16, 9, 3)
ids, pos = torch.randint(0, 1000, (n,)), torch.randint(100, 300, (n,))
for _ in range(200):
    graphs.run(ids, pos, common)
best = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(2000):
        graphs.run(ids, pos, common)
    best.append((time.perf_counter() - t) / 2000 * 1e6)
print(cuda_graphs.__file__)
print(f"DecodeGraphs.run host, batch {n} padded to 256: {min(best):.1f} us "
      f"(best of 5 x 2000; all {[round(b, 1) for b in best]})")
