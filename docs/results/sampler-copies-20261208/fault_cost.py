"""A 50 MB float32 copy made afresh each time, and torch's argmax over it. Run plain (20.9 ms a copy here), with
MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 (3.9), or THP_MEM_ALLOC_ENABLE=1 (5.3)."""
import torch, time
torch.set_num_threads(2)
x = torch.randn(256, 49152)
ts=[]
for i in range(20):
    t=time.perf_counter(); y = x.to(torch.float32, copy=True); ts.append(time.perf_counter()-t); del y
ts.sort(); print("copy 50MB ms", [round(v*1e3,1) for v in ts[:3]], "median", round(ts[10]*1e3,1))
ts=[]
for i in range(20):
    t=time.perf_counter(); y = x.argmax(-1); ts.append(time.perf_counter()-t)
ts.sort(); print("argmax ms", round(ts[10]*1e3,1))
