# The bf16 decode attention of this checkout, timed over 30 layers' K/V pools (1.5 GB, out of cache):
#   python decode_groups_ab.py R m [rounds]  -> ms per 30-layer sweep, best of rounds, for R requests of m rows
# (m = 1: plain decode rows; m > 1: a request's row and m - 1 drafts, contexts c, c + 1, ...).
# Run from the root of the checkout to time (its kernels/ builds its own extension).
import sys, time
sys.path.insert(0, ".")
import torch
from kernels.cpu_extension import load_extension
ext = load_extension()
torch.set_num_threads(2)
R, m = int(sys.argv[1]), int(sys.argv[2]); rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
H, KVH, D, bs, nb, W, L = 9, 3, 64, 16, 4096, 18, 30
g = torch.Generator().manual_seed(0)
caches = [(torch.randn(nb, bs, KVH, D, generator=g).bfloat16(), torch.randn(nb, bs, KVH, D, generator=g).bfloat16()) for _ in range(L)]
perm = torch.randperm(nb, generator=g)
tables, ctxs = [], []
for r in range(R):
    t = perm[(r * W) % (nb - W):(r * W) % (nb - W) + W].tolist()
    c = 235 + (r * 7) % 30
    for i in range(m):
        tables.append(t); ctxs.append(c + i)
bt, cl = torch.tensor(tables), torch.tensor(ctxs)
q = torch.randn(len(cl), H, D, generator=g).bfloat16()
best = 1e9
for _ in range(rounds):
    t0 = time.perf_counter()
    for k, v in caches:
        ext.paged_decode_attention_bf16(q, k, v, bt, cl, 0.125)
    best = min(best, time.perf_counter() - t0)
print(f"R={R} m={m} rows={len(cl)}: {best * 1e3:.1f} ms")
