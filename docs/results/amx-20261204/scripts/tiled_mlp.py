# One SmolLM2-135M MLP (576 -> 2x1536 -> 576, bf16) at a big prefill step's 2,304 rows: all rows at once
# against row tiles that keep gate_up's output in cache (gate_up, SiLU-and-mul, down per tile). 30 "layers"
# with their own weights, so the weights are not all hot. Median of 15 runs; 2 threads. The weights prepacked
# for oneDNN as the engine's are (kernels.layer_ops.linear_packed).
import sys; sys.path.insert(0, ".")
from kernels.layer_ops import linear_packed
import time, torch, torch.nn.functional as F
torch.set_num_threads(2); torch.manual_seed(0)
L, H, I, R = 30, 576, 1536, 2304
Wgu = [torch.randn(2 * I, H, dtype=torch.bfloat16) * 0.02 for _ in range(L)]
Wd = [torch.randn(H, I, dtype=torch.bfloat16) * 0.02 for _ in range(L)]
x = torch.randn(R, H, dtype=torch.bfloat16)
pack = lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None)
Wgu, Wd = [pack(w) for w in Wgu], [pack(w) for w in Wd]
def mlp(x, gu_w, d_w):
    gu = linear_packed(x, gu_w, None)
    return linear_packed(F.silu(gu[:, :I]) * gu[:, I:], d_w, None)
def full(x):
    for l in range(L): y = mlp(x, Wgu[l], Wd[l])
    return y
def tiled(x, t):
    for l in range(L): y = torch.cat([mlp(x[i:i + t], Wgu[l], Wd[l]) for i in range(0, R, t)])
    return y
def bench(f):
    for _ in range(3): f()
    ts = []
    for _ in range(15):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return sorted(ts)[len(ts) // 2] * 1e3
for rnd in range(3):
    print(f"round {rnd + 1}: all rows {bench(lambda: full(x)):.1f} ms; " + "; ".join(
        f"tiles of {t} {bench(lambda: tiled(x, t)):.1f} ms" for t in (128, 256, 512, 1152)))
