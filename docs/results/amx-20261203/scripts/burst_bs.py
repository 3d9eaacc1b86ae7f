# burst cap 256 offline with LLM(**kwargs from argv), e.g.: python burst_bs.py block_size=32
import sys, ast
sys.path.insert(0, ".")
from serving import LLM
from loadtest.workloads import burst_requests, BenchRequest
from loadtest.overhead import run_engine_inprocess
kw = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in sys.argv[1:])}
llm = LLM(**kw)
reqs = burst_requests(llm.tokenizer, 256)
run_engine_inprocess(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
results, dur = run_engine_inprocess(llm, reqs)
toks = sum(r.output_tokens for r in results)
print(f"{kw} {toks / dur:.1f} tok/s ({toks} tokens, {dur:.1f} s)", flush=True)
