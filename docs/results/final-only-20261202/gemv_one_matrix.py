import time, torch, sys
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from kernels.cpu_extension import load_extension
ext = load_extension()
w = torch.randn(3072, 576).to(torch.bfloat16); x = torch.randn(16, 576).to(torch.bfloat16)
for _ in range(50): ext.gemv_bf16(x, w)
t = time.perf_counter(); n = 3000
for _ in range(n): ext.gemv_bf16(x, w)
dt = (time.perf_counter() - t) / n
print(f"{2*3072*576*16/dt/1e9:.0f} GF/s, {dt*1e6:.1f} us/call", flush=True)
