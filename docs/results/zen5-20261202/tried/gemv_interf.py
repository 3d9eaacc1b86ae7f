# GEMVs of one layer's weights x30 (in cache), quiet vs with interferer: python gemv_interf.py ROWS
import os, subprocess, sys, time, torch
torch.set_num_threads(2)
from kernels.cpu_extension import load_extension
ext = load_extension()
M = int(sys.argv[1])
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ws = [ext.pack_vnni_bf16((torch.randn(n, k) * k ** -0.5).to(torch.bfloat16)) for n, k in shapes]
a = torch.randn(M, 576).to(torch.bfloat16); b = torch.randn(M, 1536).to(torch.bfloat16)
flop = 2 * M * sum(n * k for n, k in shapes) * 30
def tok():
    for _ in range(30):
        for w, (_, k) in zip(ws, shapes): ext.gemv_bf16(a if k == 576 else b, w)
def rate(secs=3.0):
    tok(); n = 0; t = time.perf_counter()
    while time.perf_counter() - t < secs: tok(); n += 1
    return flop * n / (time.perf_counter() - t) / 1e9
out = []
for cond in ("quiet", "interf", "quiet", "interf"):
    p = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "interfere.py"), "0.7", "2.8", "60"]) if cond == "interf" else None
    time.sleep(0.1)
    out.append(f"{cond} {rate():.0f}")
    if p: p.kill(); p.wait()
print(" ".join(out), "GFLOP/s")
