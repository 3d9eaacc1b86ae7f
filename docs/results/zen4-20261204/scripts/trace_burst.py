# Where an offline burst (cap 256) spends its steps: run from the repository root with .venv/bin/python.
import time, statistics, sys
from serving.llm import LLM
from loadtest.workloads import burst_requests
from loadtest.offline import generate_token_ids, BenchRequest
import os
llm = LLM(None, num_speculative_tokens=int(os.environ.get("SPEC", "4")))  # SPEC=0: no drafts
eng = llm.engine
reqs = burst_requests(llm.tokenizer, 256)
generate_token_ids(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
steps = []
orig = eng.scheduler.schedule
cur = {}
def sched():
    out = orig(); cur['out'] = out; return out
eng.scheduler.schedule = sched
ostep = eng.step
def step():
    t0 = time.perf_counter(); r = ostep(); t1 = time.perf_counter()
    o = cur.get('out')
    if o is not None and o.requests:
        steps.append((t1 - t0, len(o.requests), o.total_num_tokens))
    return r
eng.step = step
t0 = time.perf_counter()
generate_token_ids(llm, reqs)
wall = time.perf_counter() - t0
pre = [s for s in steps if s[2] > s[1] * 5]; dec = [s for s in steps if s[2] <= s[1] * 5]
print(f"wall {wall:.2f} s, {len(steps)} steps, sum {sum(s[0] for s in steps):.2f}; prefill {sum(s[0] for s in pre):.2f} s in {len(pre)} steps ({sum(s[2] for s in pre)} tokens); decode {sum(s[0] for s in dec):.2f} s in {len(dec)}")
for lo, hi in ((1, 8), (9, 64), (65, 128), (129, 256)):
    b = [s for s in dec if lo <= s[1] <= hi]
    if b: print(f"  decode {lo}-{hi}: {len(b)} steps, {1e3*statistics.mean(s[0] for s in b):.1f} ms/step, rows {statistics.mean(s[2] for s in b):.0f}, tokens/step-ms {statistics.mean(s[2]/s[0]/1e3 for s in b):.2f}")
for s in pre[:5]: print("  prefill step", f"{s[0]*1e3:.0f} ms, {s[1]} reqs, {s[2]} tokens")
