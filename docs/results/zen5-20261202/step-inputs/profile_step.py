"""cProfile of Engine.step over one stream of 300 tokens offline (run from the repository root)."""
import time, torch, sys, cProfile, pstats
sys.path.insert(0, ".")
from serving import LLM
from workers.sampling_params import SamplingParams
llm = LLM()
eng = llm.engine
real = eng.step
pr = cProfile.Profile(); n = [0]
def step(*a, **k):
    n[0] += 1
    if n[0] > 5: pr.enable()
    try: return real(*a, **k)
    finally: pr.disable()
eng.step = step
t = time.perf_counter()
llm.generate([list(range(1000, 1128))], SamplingParams(max_tokens=300, ignore_eos=True, temperature=0), use_tqdm=False)
print("steps", n[0], "wall per step ms", 1e3 * (time.perf_counter() - t) / n[0])
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
