# Speculation's odds, A/B/C in one process so that the host's drift between processes does not count: one
# engine (the default model, float32, 2 threads, at most N requests running) serves rounds of 64 greedy requests
# (prompts of ~12 tokens, 64 tokens each, EOS ignored), each round in one mode, the modes in turn: `learnt`
# (the default: drafts beside others need the odds that the engine's timed steps give), `fixed` (odds 0.5, no
# step costs) and `off` (no drafts). Per round: output tok/s while requests waited (every slot busy) and over
# the whole round, drafts made and kept, and for `learnt` the median odds a draft needed beside others.
# PYTHONPATH=. .venv/bin/python docs/results/spec-odds-20261206/interleaved.py 16 3
import statistics, sys, time
from serving import LLM, SamplingParams
n, rounds = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(dtype="float32", num_threads=2, max_num_seqs=n)
engine, s = llm.engine, llm.engine.scheduler
spec_tokens = s.config.num_speculative_tokens
learnt = s.step_costs
llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))
p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
results = {}
for r in range(rounds):
    for mode in ("learnt", "fixed", "off"):
        s.config.num_speculative_tokens = 0 if mode == "off" else spec_tokens
        s.step_costs = learnt if mode == "learnt" else None  # `learnt` keeps what it learnt in earlier rounds
        drafts0, kept0, gen0 = s.num_draft_tokens, s.num_accepted_tokens, engine.outputs.generation_tokens
        for i in range(64):
            engine.add_request(f"{r}-{mode}-{i}", f"Story number {i}: once upon a time there was a", p)
        odds, start, steady = [], time.perf_counter(), None
        while engine.has_unfinished_requests():
            waited = s.num_waiting > 0
            engine.step()
            if waited:
                odds.append(s._keep_odds)
                steady = (time.perf_counter() - start, engine.outputs.generation_tokens - gen0)
        total, done = time.perf_counter() - start, engine.outputs.generation_tokens - gen0
        results.setdefault(mode, []).append(steady[1] / steady[0])
        print(f"round {r} max {n:2d} {mode:6s}: while requests waited {steady[1] / steady[0]:6.1f} tok/s, whole round "
              f"{done / total:6.1f} tok/s ({total:.1f} s); draft tokens {s.num_draft_tokens - drafts0} kept "
              f"{s.num_accepted_tokens - kept0}" + (f"; odds needed {statistics.median(odds):.2f}" if mode == "learnt" else ""),
              flush=True)
print("medians while requests waited: " + ", ".join(f"{m} {statistics.median(v):.1f}" for m, v in results.items()))
