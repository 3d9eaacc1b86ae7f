"""One stream offline: 5 generations of 128 tokens after a 128-token prompt (run from the repository root)."""
import sys, time
sys.path.insert(0, ".")
from serving import LLM
from workers.sampling_params import SamplingParams
llm = LLM(); p = list(range(1000, 1128)); sp = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate([p], sp, use_tqdm=False)
rates = []
for _ in range(5):
    t = time.perf_counter(); llm.generate([p], sp, use_tqdm=False); rates.append(128 / (time.perf_counter() - t))
print(" ".join(f"{r:.1f}" for r in rates), "median", sorted(rates)[2])
