# 1-row GEMV over every SmolLM2 layer (weights from memory) vs a plain read of the same bytes, GB/s, alternated
import sys, time, torch
torch.set_num_threads(2)
from kernels.cpu_extension import load_extension
ext = load_extension()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
g = torch.Generator().manual_seed(0)
plain = [[(torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16) for n, k in shapes] for _ in range(30)]
vnni = [[ext.pack_vnni_bf16(w) for w in lw] for lw in plain]
head = (torch.randn(49152, 576, generator=g) * 0.04).to(torch.bfloat16); head_v = ext.pack_vnni_bf16(head)
nbytes = sum(w.numel() * 2 for lw in plain for w in lw)
a = torch.randn(1, 576).to(torch.bfloat16); b = torch.randn(1, 1536).to(torch.bfloat16)
flat = torch.cat([w.flatten() for lw in plain for w in lw])
def med(fn, reps=7):
    fn(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2]
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    r = {}
    r["rowmajor"] = nbytes / med(lambda: [ext.gemv_bf16(a if k == 576 else b, w) for lw in plain for w, (_, k) in zip(lw, shapes)]) / 1e9
    r["vnni"] = nbytes / med(lambda: [ext.gemv_bf16(a if k == 576 else b, w) for lw in vnni for w, (_, k) in zip(lw, shapes)]) / 1e9
    r["head_vnni"] = head.numel() * 2 / med(lambda: ext.gemv_bf16(a, head_v)) / 1e9
    r["sum"] = nbytes / med(lambda: flat.sum()) / 1e9
    print(" ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
