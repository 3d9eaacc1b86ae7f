# 128 greedy requests (prompts of ~12 tokens, 64 tokens each, EOS ignored), at most N running (one that ends is
# replaced by the next), the default model, in-process engine, float32, 2 threads. Output tok/s while requests
# still waited (every slot busy: the steady state of a loaded server) and over the whole run (whose tail, the
# last requests ending apart, a closed batch's artefact, costs the speculating runs more), with speculation whose
# drafts beside others need the odds the engine's timed steps give (`learnt`, the default), with the fixed odds
# of 0.5 (`fixed`: no step costs), or without speculation (`off`). Also the drafts made and kept and, for
# `learnt`, the median odds a draft needed beside others while requests waited.
# PYTHONPATH=. .venv/bin/python docs/results/spec-odds-20261206/open_loop.py 16 learnt
import statistics, sys, time
from serving import LLM, SamplingParams
n, mode = int(sys.argv[1]), sys.argv[2]
llm = LLM(dtype="float32", num_threads=2, max_num_seqs=n, **({"num_speculative_tokens": 0} if mode == "off" else {}))
engine, s = llm.engine, llm.engine.scheduler
if mode == "fixed":
    s.step_costs = None
llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))
p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
for i in range(128):
    engine.add_request(str(i), f"Story number {i}: once upon a time there was a", p)
done, odds, start = 0, [], time.perf_counter()
steady = None
while engine.has_unfinished_requests():
    waited = s.num_waiting > 0
    outs = engine.step()
    done = engine.outputs.generation_tokens
    if waited:
        odds.append(s._keep_odds)
        steady = (time.perf_counter() - start, done)
total = time.perf_counter() - start
print(f"max {n:2d} {mode:6s}: while requests waited {steady[1] / steady[0]:6.1f} tok/s ({steady[1]} tokens in "
      f"{steady[0]:.1f} s), whole run {done / total:6.1f} tok/s ({total:.1f} s); draft tokens "
      f"{s.num_draft_tokens} kept {s.num_accepted_tokens}"
      + (f"; odds needed {statistics.median(odds):.2f}" if mode == "learnt" else ""), flush=True)
