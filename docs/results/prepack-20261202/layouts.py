"""Every linear layer of SmolLM2-135M's 30 layers in turn (each layer its own weights, so they stream from
memory), 2 threads, median of 5, GFLOP/s, for four ways of running x[M, K] @ W^T in bfloat16:
  gemv      the compiled GEMV on the row-major weight
  vnni      the compiled GEMV on the VNNI copy (pack_vnni_bf16)
  flinear   F.linear (oneDNN, reordering the plain weight on each call)
  packed    oneDNN over its blocked copy (torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise)
Run from the repository root: python docs/results/prepack-20261202/layouts.py [ROUNDS [ROWS ...]]
(KINDS=vnni,packed times only those.)
(layouts-1-512-rows.txt: `layouts.py 2`, when the VNNI GEMV was timed up to 128 rows only;
layouts-96-2048-rows.txt: `layouts.py 2 96 128 192 256 512` and `layouts.py 2 1024 2048`, vnni and packed.)"""
import os, sys, time, torch
import torch.nn.functional as F
torch.set_num_threads(2)
from kernels.cpu_extension import load_extension
from kernels.layer_ops import linear_packed
ext = load_extension()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
g = torch.Generator().manual_seed(0)
plain = [[(torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16) for n, k in shapes] for _ in range(30)]
copies = {"gemv": plain, "flinear": plain,
          "vnni": [[ext.pack_vnni_bf16(w) for w in lw] for lw in plain],
          "packed": [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in lw] for lw in plain]}
call = {"gemv": ext.gemv_bf16, "vnni": ext.gemv_bf16, "flinear": F.linear, "packed": lambda x, w: linear_packed(x, w, None)}
flop_row = 2 * sum(n * k for n, k in shapes) * 30
ROWS = tuple(int(a) for a in sys.argv[2:]) or (1, 4, 8, 16, 24, 32, 48, 64, 128, 512)
def med(fn, reps=5):
    fn(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2]
print("GFLOP/s | " + " | ".join(f"{m} rows" for m in ROWS))
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for kind in os.environ.get("KINDS", "gemv,vnni,flinear,packed").split(","):
        rates = []
        for m in ROWS:
            if kind == "gemv" and m > 128:
                rates.append("-"); continue
            a = torch.randn(m, 576).to(torch.bfloat16); b = torch.randn(m, 1536).to(torch.bfloat16)
            f = call[kind]
            t = med(lambda: [f(a if k == 576 else b, w) for lw in copies[kind] for w, (_, k) in zip(lw, shapes)])
            rates.append(f"{flop_row * m / t / 1e9:.0f}")
        print(f"{kind} | " + " | ".join(rates), flush=True)
