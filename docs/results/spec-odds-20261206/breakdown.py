# Where a run's time goes by kind of step: 128 greedy requests (64 tokens each, ~12-token prompts), at most N
# running, the default model, float32, 2 threads; `off` (no speculation) or `fixed` (drafts at odds 0.5): steps,
# seconds in `runner.execute`, rows, per kind (decode or with a prompt chunk, with or without drafts).
# PYTHONPATH=. .venv/bin/python docs/results/spec-odds-20261206/breakdown.py 16 off
import sys, time, collections
from serving import LLM, SamplingParams
n, mode = int(sys.argv[1]), sys.argv[2]
llm = LLM(dtype="float32", num_threads=2, max_num_seqs=n, **({"num_speculative_tokens": 0} if mode == "off" else {}))
engine, s = llm.engine, llm.engine.scheduler
if mode == "fixed": s.step_costs = None
llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))
p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
for i in range(128):
    engine.add_request(str(i), f"Story number {i}: once upon a time there was a", p)
acc = collections.defaultdict(lambda: [0, 0.0, 0])
orig = engine.runner.execute
def ex(out):
    t = time.perf_counter(); r = orig(out); d = time.perf_counter() - t
    kind = ("mixed" if out.admitted else "decode") + ("+drafts" if out.total_num_tokens > len(out.requests) + sum(len(q.prompt_token_ids) for q in out.admitted) else "")
    a = acc[kind]; a[0] += 1; a[1] += d; a[2] += out.total_num_tokens
    return r
engine.runner.execute = ex
t0 = time.perf_counter()
while engine.has_unfinished_requests():
    engine.step()
tot = time.perf_counter() - t0
ex_t = sum(a[1] for a in acc.values())
print(mode, f"total {tot:.1f} s, execute {ex_t:.1f} s")
for k, a in sorted(acc.items()):
    print(f"  {k:14s} steps {a[0]:4d} time {a[1]:6.1f} s rows {a[2]:6d}  ms/step {a[1]/a[0]*1000:6.1f} rows/step {a[2]/a[0]:5.1f}")
