"""Median time of build_step_inputs per step while generating for 1, 16 and 64 requests (run from the repository root)."""
import time, torch, sys
sys.path.insert(0, ".")
torch.set_num_threads(2)
from serving import LLM
from workers.sampling_params import SamplingParams
from workers import step_inputs
llm = LLM()
eng = llm.engine
times = []
real = step_inputs.build_step_inputs
def timed(*a, **k):
    t = time.perf_counter(); r = real(*a, **k); times.append(time.perf_counter() - t); return r
import workers.model_runner as mr
mr.build_step_inputs = timed
for n in (1, 16, 64):
    times.clear()
    llm.generate([list(range(1000, 1128))] * n, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0), use_tqdm=False)
    ts = sorted(times[2:])
    print(n, "rows: build_step_inputs median", round(1e6 * ts[len(ts)//2]), "us over", len(ts), "steps")
