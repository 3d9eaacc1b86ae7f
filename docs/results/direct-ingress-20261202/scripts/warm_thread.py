import sys, time, os, threading
sys.path.insert(0, '/work/main')
from transformers import AutoTokenizer
from serving import LLM
from loadtest.workloads import burst_requests
from loadtest.offline import run_engine
M = os.path.expanduser('~/.cache/kvrelay/models/SmolLM2-135M-Instruct')
reqs = burst_requests(AutoTokenizer.from_pretrained(M), 256)
def body():
    llm = LLM(model=M, enable_prefix_caching=False)
    r = run_engine(llm, reqs)
    print('thread' if len(sys.argv) > 1 else 'main', round(r.useful_tokens / r.wall_s, 1), 'tok/s', flush=True)
if len(sys.argv) > 1:
    t = threading.Thread(target=body); t.start(); t.join()
else:
    body()
