# One offline burst (cap 256) with oneDNN's rows padded to a multiple of B (`CppLayerOps.onednn_row_bucket`;
# 1: no padding): python bucket_ab.py B -> tok/s and the oneDNN primitives compiled during the burst
# (with ONEDNN_VERBOSE=profile_create in the environment, counted from stderr by the caller).
import sys, time
sys.path.insert(0, ".")
from serving import LLM
from loadtest.workloads import burst_requests, BenchRequest
from loadtest.overhead import run_engine_inprocess
bucket = int(sys.argv[1])
llm = LLM()
llm.engine.model.ops.onednn_row_bucket = bucket
reqs = burst_requests(llm.tokenizer, 256)
run_engine_inprocess(llm, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)])
print("BURST-START", file=sys.stderr, flush=True)
results, dur = run_engine_inprocess(llm, reqs)
print("BURST-END", file=sys.stderr, flush=True)
toks = sum(r.output_tokens for r in results)
print(f"bucket {bucket}: {toks / dur:.1f} tok/s, {dur:.2f} s")
