# burst cap 256 offline with oneDNN's packed linear fed row counts rounded up to a ladder: python pad_burst.py STEP
import sys, time, torch
sys.path.insert(0, ".")
from kernels import layer_ops
step = int(sys.argv[1])
real = layer_ops.linear_packed
def bucket(m):
    if m <= 256: return -(-m // step) * step
    if m <= 1024: return -(-m // 64) * 64
    return -(-m // 256) * 256
def padded(x, w, b):
    m = x.shape[0]; p = bucket(m)
    if p == m: return real(x, w, b)
    xp = x.new_empty(p, x.shape[1]); xp[:m] = x; xp[m:] = 0
    return real(xp, w, b)[:m]
if step: layer_ops.linear_packed = padded
from serving import LLM
from loadtest.workloads import burst_requests, BenchRequest
from loadtest.overhead import run_engine_inprocess
llm = LLM()
reqs = burst_requests(llm.tokenizer, 256)
run_engine_inprocess(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
results, dur = run_engine_inprocess(llm, reqs)
toks = sum(r.output_tokens for r in results)
print(f"step {step}: {toks / dur:.1f} tok/s ({toks} tokens, {dur:.1f} s)", flush=True)
