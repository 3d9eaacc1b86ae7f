# burst cap 256 offline with speculation, one record per step: python spec_trace.py [k=v ...]
# -> tok/s, acceptance, and decode-only steps bucketed by requests (rows = requests + drafts)
import sys, ast, time, collections
sys.path.insert(0, ".")
from serving import LLM
from loadtest.workloads import burst_requests, BenchRequest
from loadtest.overhead import run_engine_inprocess
kw = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in sys.argv[1:])}
cap = kw.pop("cap", 256)
if kw.pop("useless_drafts", False):  # the worst case: every request drafts its full K, none kept
    import workers.scheduler as sm
    sm.propose = lambda tokens, k, max_n, min_n: [7] * k if k > 0 else []
llm = LLM(**kw)
eng = llm.engine
steps = []
orig = eng.runner.execute
def traced(sched):
    drafts = sum(len(r.spec_token_ids) for r in sched.requests)
    t = time.perf_counter()
    out = orig(sched)
    dec = sum(1 for r, n in zip(sched.requests, sched.num_new_tokens) if n == 1 + len(r.spec_token_ids))
    steps.append((sched.total_num_tokens, len(sched.requests), dec, drafts, time.perf_counter() - t))
    return out
eng.runner.execute = traced
reqs = burst_requests(llm.tokenizer, cap)
run_engine_inprocess(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
steps.clear()
s = eng.scheduler
d0, a0, n0 = s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts
results, dur = run_engine_inprocess(llm, reqs)
toks = sum(r.output_tokens for r in results)
print(f"{kw} {toks / dur:.1f} tok/s ({toks} tokens, {dur:.2f} s), {len(steps)} steps, execute {sum(x[4] for x in steps):.2f} s; "
      f"drafting steps {s.num_drafts - n0}, drafts {s.num_draft_tokens - d0}, kept {s.num_accepted_tokens - a0}")
pre = [x for x in steps if x[2] < x[1]]
dec = [x for x in steps if x[2] == x[1]]
print(f"steps with prompt tokens: {len(pre)}, {sum(x[4] for x in pre):.2f} s")
b = collections.defaultdict(lambda: [0, 0.0, 0, 0])
for n, r, d, dr, t in dec:
    k = next(c for c in (4, 8, 16, 32, 64, 128, 256) if r <= c)
    b[k][0] += 1; b[k][1] += t; b[k][2] += r; b[k][3] += dr
for k in sorted(b):
    c, t, r, dr = b[k]
    print(f"decode-only requests<={k}: {c} steps, {t:.2f} s, {r} requests, {dr} drafts, {t / c * 1e3:.1f} ms/step, {(r + dr) / c:.0f} rows/step")
