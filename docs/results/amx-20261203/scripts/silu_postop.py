# gate_up + silu_and_mul at 2,048 rows, 30 layers: one matmul and the compiled op, against oneDNN post-ops (swish on
# the gate matmul, then the up matmul times it); run from the repository root
import torch, time, sys
sys.path.insert(0, ".")
from kernels.layer_ops import CppLayerOps, linear_packed
torch.set_num_threads(2)
ops = CppLayerOps()
g = torch.Generator().manual_seed(0)
L, M = 30, 2048
def W(n, k): return (torch.randn(n, k, generator=g) * 0.04).bfloat16()
gu = [W(3072, 576) for _ in range(L)]
gup = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in gu]
gp = [torch.ops.mkldnn._reorder_linear_weight(w[:1536].contiguous(), None) for w in gu]
upp = [torch.ops.mkldnn._reorder_linear_weight(w[1536:].contiguous(), None) for w in gu]
hs = [torch.randn(M, 576, generator=g).bfloat16() for _ in range(4)]
def base(h, l): return ops.silu_and_mul(linear_packed(h, gup[l], None))
def fused(h, l):
    s = torch.ops.mkldnn._linear_pointwise(h, gp[l], None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(h, s, upp[l], None, "mul")
a, b = base(hs[0], 0), fused(hs[0], 0)
print("max diff", (a.float() - b.float()).abs().max().item(), "rel", ((a.float() - b.float()).abs().sum() / a.float().abs().sum()).item(), "equal frac", (a == b).float().mean().item())
def t(f):
    ts = []
    for r in range(5):
        t0 = time.perf_counter()
        for l in range(L): f(hs[l % 4], l)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[2] * 1e3
for _ in range(2): print(f"base {t(base):.1f} ms  fused {t(fused):.1f} ms")
