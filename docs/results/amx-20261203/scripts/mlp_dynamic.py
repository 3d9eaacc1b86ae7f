# 30 layers of the MLP at M rows (env M, 2048): one call per op against mlp_dynamic.cpp's chunks of 64-512 rows
# (run from the repository root; BD a scratch build folder)
import os, sys, time, torch, statistics
import torch.nn.functional as F
from torch.utils.cpp_extension import load
torch.set_num_threads(2)
root = "kernels"
ext = load(name="mlp_proto", sources=["docs/results/amx-20261203/scripts/mlp_dynamic.cpp", f"{root}/csrc_layer_ops.cpp"], extra_include_paths=[root],
           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"],
           extra_ldflags=["-fopenmp"], build_directory=os.environ.get("BD", "/tmp/mlp-proto"), verbose=False)
print("in_par", ext.in_par_threads())
sys.path.insert(0, ".")
from kernels.layer_ops import CppLayerOps, linear_packed
ops = CppLayerOps()
L = 30
M = int(os.environ.get("M", 2048))
g = torch.Generator().manual_seed(0)
def W(n, k): return (torch.randn(n, k, generator=g) * 0.04).bfloat16()
gu = [W(3072, 576) for _ in range(L)]; dn = [W(576, 1536) for _ in range(L)]
gup = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in gu]
dnp = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in dn]
hs = [(torch.randn(M, 576, generator=g)).bfloat16() for _ in range(4)]
def base(h, l): return linear_packed(ops.silu_and_mul(linear_packed(h, gup[l], None)), dnp[l], None)
def dyn(c): return lambda h, l: ext.mlp_dynamic_silu(h, gup[l], dnp[l], c, 576)
ref = base(hs[0], 0)
for c in (128, 256, 512):
    o = dyn(c)(hs[0], 0)
    print("chunk", c, "equal", torch.equal(o, ref), (o.float() - ref.float()).abs().max().item())
def t(f, reps=5):
    ts = []
    for r in range(reps):
        t0 = time.perf_counter()
        for l in range(L): f(hs[l % 4], l)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
variants = {"base": base, **{f"dyn{c}": dyn(c) for c in (64, 128, 256, 512)}}
for rnd in range(2):
    print(" ".join(f"{k}={t(f):.1f}ms" for k, f in variants.items()), flush=True)
