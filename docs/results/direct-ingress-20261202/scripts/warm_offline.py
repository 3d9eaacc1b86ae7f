import sys, time, os
sys.path.insert(0, '/work/main')
from transformers import AutoTokenizer
from serving import LLM
from loadtest.workloads import burst_requests
from loadtest.offline import run_engine
M = os.path.expanduser('~/.cache/kvrelay/models/SmolLM2-135M-Instruct')
reqs = burst_requests(AutoTokenizer.from_pretrained(M), 256)
llm = LLM(model=M) if len(sys.argv) < 2 else LLM(model=M, **eval(sys.argv[1]))
for i in range(int(os.environ.get('N', 3))):
    r = run_engine(llm, reqs)
    print(i, round(r.useful_tokens / r.wall_s, 1), 'tok/s', round(r.wall_s, 2), 's', flush=True)
