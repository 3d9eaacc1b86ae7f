# causal attention of 16 sequences x 128 tokens, 9 query / 3 KV heads of 64 (one layer of a 2,048-token prefill step):
# torch's SDPA (flash attention for CPU) per sequence, bf16, 2 threads
import time, torch
torch.set_num_threads(2)
import torch.nn.functional as F
q = torch.randn(16, 9, 128, 64).to(torch.bfloat16); k = torch.randn(16, 3, 128, 64).to(torch.bfloat16); v = torch.randn_like(k)
def run():
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
run(); ts = []
for _ in range(20):
    t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
med = sorted(ts)[10]
flop = 16 * 9 * 128 * 128 * 64 * 2 * 2 / 2  # causal half
print(f"SDPA batched: {med * 1e3:.2f} ms per layer, {flop / med / 1e9:.0f} GFLOP/s (causal FLOPs); x30 layers x16 steps = {med * 30 * 16:.2f} s")
