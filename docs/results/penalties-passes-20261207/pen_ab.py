"""_apply_penalties at batch 256 x 49,152 (the default model's vocabulary), float32, on this CPU (2 threads):
median of 7 calls, each on a fresh copy of the logits. Usage: python pen_ab.py TREE"""
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
from workers.penalties import _apply_penalties
from workers.sampling_params import SamplingParams
torch.set_num_threads(2)
n, V = 256, 49152
g = torch.Generator().manual_seed(0)
x0 = torch.randn(n, V, generator=g)
counts = (torch.rand(n, V, generator=g) < 0.002).float() * 2
prompt = torch.rand(n, V, generator=g) < 0.003
for name, kw in {"frequency 0.5, presence 0.2, repetition 1.1": dict(frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.1),
                 "frequency 0.5": dict(frequency_penalty=0.5), "repetition 1.2": dict(repetition_penalty=1.2)}.items():
    params = [SamplingParams(**kw)] * n
    ts = []
    for _ in range(7):
        x = x0.clone(); t = time.perf_counter(); _apply_penalties(x, params, counts.clone(), prompt); ts.append(time.perf_counter() - t)
    print(f"{name}: {sorted(ts)[3] * 1e3:.1f} ms")
