# Whether oneDNN's packed linear gives a slice of rows the same bits as the same rows inside a 2,048-row call
# (run from the repository root)
import torch
from kernels.layer_ops import linear_packed
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
for n, k in ((3072, 576), (576, 1536), (960, 576), (576, 576)):
    w = (torch.randn(n, k, generator=g) * 0.04).bfloat16()
    p = torch.ops.mkldnn._reorder_linear_weight(w, None)
    x = torch.randn(2048, k, generator=g).bfloat16()
    full = linear_packed(x, p, None)
    res = []
    for m in (1, 8, 9, 33, 128, 256, 512, 1000):
        part = linear_packed(x[:m].contiguous(), p, None)
        res.append((m, torch.equal(part, full[:m])))
    torch.set_num_threads(1)
    one = linear_packed(x, p, None)
    torch.set_num_threads(2)
    print((n, k), res, "1thr equal", torch.equal(one, full))
