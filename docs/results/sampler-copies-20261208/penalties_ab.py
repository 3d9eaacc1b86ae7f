"""A batch-256 step's logits (a fresh [256, 49,152] float32 tensor, as the LM head returns) through the sampler,
each kind of row; medians of 30 steps, and the minor page faults a step.

    cd TREE && TREE=label PYTHONPATH=. python docs/results/sampler-copies-20261208/penalties_ab.py
"""
import os, resource, statistics, sys, time
import torch
from workers.penalties import TokenCounts
from workers.sampler import launch_sample
from workers.sampling_params import SamplingParams

torch.set_num_threads(2)
tree = os.environ.get('TREE', '?')
R, V = 256, 49152
g = torch.Generator().manual_seed(0)
base = torch.randn(R, V, generator=g)
hist = [(torch.randint(0, V, (160,), generator=g).tolist(), 128) for _ in range(R)]
kinds = {
    "greedy, frequency penalty": dict(temperature=0, frequency_penalty=0.1),
    "greedy, repetition penalty": dict(temperature=0, repetition_penalty=1.1),
    "sampled, frequency penalty": dict(temperature=0.8, frequency_penalty=0.1),
    "sampled, three penalties": dict(temperature=0.8, frequency_penalty=0.1, presence_penalty=0.1, repetition_penalty=1.1),
}
for name, kw in kinds.items():
    params = [SamplingParams(max_tokens=300, **kw) for _ in range(R)]
    counts, ids = TokenCounts(), [f"r{i}" for i in range(R)]
    gens = [None] * R
    walls, faults = [], []
    for step in range(36):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        logits = base.clone()  # the LM head's output: a new tensor each step
        launch_sample(logits, params, gens, histories=hist, counts=counts, request_ids=ids).result()
        del logits
        if step >= 6:
            walls.append(time.perf_counter() - t)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(f"{tree} {name}: {1e3 * statistics.median(walls):.1f} ms a step, "
          f"{statistics.median(faults):.0f} faults", flush=True)
