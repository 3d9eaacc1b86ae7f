# The flash path's pieces for 16 prompts x 128 tokens, one layer: SDPA (GQA or expanded), gathers, scatter
import torch, time, torch.nn.functional as F
torch.set_num_threads(2)
r, n, h, kvh, d = 16, 128, 9, 3, 64
def t(f, reps=30):
    for _ in range(3): f()
    t0 = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t0) / reps * 1e3
q = torch.randn(r * n, h, d).bfloat16(); k = torch.randn(r * n, kvh, d).bfloat16(); v = torch.randn(r * n, kvh, d).bfloat16()
q4 = q.view(r, n, h, d).transpose(1, 2); k4 = k.view(r, n, kvh, d).transpose(1, 2); v4 = v.view(r, n, kvh, d).transpose(1, 2)
print("sdpa gqa strided", t(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)))
qc, kc, vc = q4.contiguous(), k4.contiguous(), v4.contiguous()
print("sdpa gqa contig", t(lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)))
ke, ve = kc.repeat_interleave(3, 1), vc.repeat_interleave(3, 1)
print("sdpa expanded", t(lambda: F.scaled_dot_product_attention(qc, ke, ve, is_causal=True)))
print("sdpa expanded strided q", t(lambda: F.scaled_dot_product_attention(q4, ke, ve, is_causal=True)))
# one big: as a varlen? batch*heads
rows = torch.arange(r * n)
out = torch.empty_like(q)
print("index_select q", t(lambda: q.index_select(0, rows)))
o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
print("scatter out", t(lambda: out.__setitem__(rows, o.transpose(1, 2).reshape(r * n, h, d))))
print("copy out", t(lambda: out.copy_(o.transpose(1, 2).reshape(r * n, h, d))))
print("repeat kv", t(lambda: (kc.repeat_interleave(3, 1), vc.repeat_interleave(3, 1))))
