# burst cap 256 offline with this checkout's defaults: python burst_offline.py
import sys, time
sys.path.insert(0, ".")
from serving import LLM
from loadtest.workloads import burst_requests, BenchRequest
from loadtest.overhead import run_engine_inprocess
llm = LLM()
reqs = burst_requests(llm.tokenizer, 256)
run_engine_inprocess(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
results, dur = run_engine_inprocess(llm, reqs)
toks = sum(r.output_tokens for r in results)
print(f"{toks / dur:.1f} tok/s ({toks} tokens, {dur:.1f} s)", flush=True)
