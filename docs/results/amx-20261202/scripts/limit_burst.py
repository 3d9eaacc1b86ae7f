# burst cap 256 offline with the VNNI GEMV (and row-major GEMV) up to LIMIT rows: python limit_burst.py LIMIT
import sys, time
sys.path.insert(0, ".")
from kernels import layer_ops
limit = int(sys.argv[1])
layer_ops.CppLayerOps.__init__.__defaults__ = (min(limit, layer_ops.GEMV_MAX_ROWS), limit)
from serving import LLM
from loadtest.workloads import burst_requests, BenchRequest
from loadtest.overhead import run_engine_inprocess
llm = LLM()
reqs = burst_requests(llm.tokenizer, 256)
run_engine_inprocess(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
t = time.perf_counter(); results, dur = run_engine_inprocess(llm, reqs)
toks = sum(r.output_tokens for r in results)
print(f"limit {limit}: {toks / dur:.1f} tok/s ({toks} tokens, {dur:.1f} s)", flush=True)
