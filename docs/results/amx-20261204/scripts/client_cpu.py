# CPU of the bench client during one burst (cap 256) against URL
import sys, resource, asyncio, time
sys.path.insert(0, ".")
from transformers import AutoTokenizer
from loadtest.workloads import burst_requests
from loadtest.http_client import run_load
import os
tok = AutoTokenizer.from_pretrained(os.path.expanduser("~/.cache/kvrelay/models/SmolLM2-135M-Instruct"))
reqs = burst_requests(tok, 256)
url = sys.argv[1]
asyncio.run(run_load(url, "SmolLM2-135M-Instruct", reqs[:1], progress=False))
a = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
res, dur = asyncio.run(run_load(url, "SmolLM2-135M-Instruct", reqs, progress=False))
b = resource.getrusage(resource.RUSAGE_SELF)
toks = sum(r.output_tokens for r in res)
print(f"{toks/dur:.1f} tok/s {dur:.2f} s; client user {b.ru_utime-a.ru_utime:.2f} sys {b.ru_stime-a.ru_stime:.2f}; chunks {sum(len(r.token_times) for r in res)}")
