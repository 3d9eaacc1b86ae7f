# one stream offline, quiet vs with a periodic interferer, alternated: python preempt_ab.py ROUNDS BUSY_MS PERIOD_MS
import os, subprocess, sys, time
sys.path.insert(0, ".")
from serving import LLM
from workers.sampling_params import SamplingParams
R, busy, period = int(sys.argv[1]), sys.argv[2], sys.argv[3]
llm = LLM()
prompt = list(range(1000, 1128))
sp = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate([prompt], sp, use_tqdm=False)
def rate(n=4):
    t = time.perf_counter()
    for _ in range(n): llm.generate([prompt], sp, use_tqdm=False)
    return n * 128 / (time.perf_counter() - t)
for r in range(R):
    q = rate()
    p = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "interfere.py"), busy, period, "60"])
    time.sleep(0.2)
    i = rate()
    p.kill(); p.wait()
    print(f"round {r}: quiet {q:.1f} tok/s, interfered {i:.1f} tok/s ({i/q:.2f})", flush=True)
