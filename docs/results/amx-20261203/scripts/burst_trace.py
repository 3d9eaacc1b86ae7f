# burst cap 256 offline, one line per step: python burst_trace.py [k=v ...]  -> step table summary
import sys, ast, time, collections
sys.path.insert(0, ".")
from serving import LLM
from loadtest.workloads import burst_requests, BenchRequest
from loadtest.overhead import run_engine_inprocess
kw = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in sys.argv[1:])}
llm = LLM(**kw)
eng = llm.engine
steps = []
orig = eng.runner.execute
def traced(sched):
    t = time.perf_counter()
    out = orig(sched)
    dec = sum(1 for n in sched.num_new_tokens if n == 1)
    steps.append((sched.total_num_tokens, len(sched.requests), dec, time.perf_counter() - t))
    return out
eng.runner.execute = traced
reqs = burst_requests(llm.tokenizer, 256)
run_engine_inprocess(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
steps.clear()
t0 = time.perf_counter()
results, dur = run_engine_inprocess(llm, reqs)
toks = sum(r.output_tokens for r in results)
print(f"{kw} {toks / dur:.1f} tok/s ({toks} tokens, {dur:.1f} s), {len(steps)} steps, execute total {sum(s[3] for s in steps):.2f} s")
pre = [s for s in steps if s[0] > s[2]]
dec = [s for s in steps if s[0] == s[2]]
print(f"steps with prompt tokens: {len(pre)}, {sum(s[3] for s in pre):.2f} s, tokens {sum(s[0] for s in pre)}")
buckets = collections.defaultdict(lambda: [0, 0.0, 0])
for n, r, d, t in dec:
    b = 1 if d <= 8 else 16 if d <= 16 else 32 if d <= 32 else 64 if d <= 64 else 128 if d <= 128 else 256
    buckets[b][0] += 1; buckets[b][1] += t; buckets[b][2] += d
for b in sorted(buckets):
    c, t, d = buckets[b]
    print(f"decode-only rows<={b}: {c} steps, {t:.2f} s, {d} tokens, {t / c * 1e3:.1f} ms/step")
for s in pre[:12]:
    print("prefill step", s[:3], f"{s[3]*1e3:.1f} ms")
