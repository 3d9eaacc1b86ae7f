# prefill only: 256 prompts x 128 tokens, max_tokens=1, offline; tokens/s and GFLOP/s (model FLOPs per token from bench)
import sys, time
sys.path.insert(0, ".")
from serving import LLM
from loadtest.workloads import burst_requests, BenchRequest
from loadtest.overhead import run_engine_inprocess
kw = dict(a.split("=") for a in sys.argv[1:])
kw = {k: int(v) for k, v in kw.items()}
llm = LLM(**kw)
reqs = burst_requests(llm.tokenizer, 256)
run_engine_inprocess(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
reqs = [BenchRequest(r.prompt_token_ids, 1) for r in reqs]
results, dur = run_engine_inprocess(llm, reqs)
toks = sum(len(r.prompt_token_ids) for r in reqs)
print(kw, f"{toks / dur:.0f} prompt tok/s, {toks * 2 * 134.5e6 / dur / 1e9:.0f} GFLOP/s (2 x 134.5M params per token)", flush=True)
