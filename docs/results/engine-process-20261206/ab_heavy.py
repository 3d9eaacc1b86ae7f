"""Streamed burst (256 requests, 128-token prompts, outputs up to 256 tokens) through `kvrelay serve`'s app on
the tiny fast model (docs/results/streams-20261206/ab_stream.py says how to write it to /tmp/tiny-fast), the
engine in the ingress's process (arg 0) or in a child process (arg 1: `engine_process`, at 9e14fee; taken out
after). The load comes from loadtest's HTTP client, which parses every event.

    git checkout 9e14fee
    PYTHONPATH=. .venv/bin/python docs/results/engine-process-20261206/ab_heavy.py LABEL 0|1
    # a GPU-like engine: its forward sleeps 2 ms with the GIL released and returns fixed logits
    PYTHONPATH=.:docs/results/engine-process-20261206/standin KVRELAY_STANDIN_MS=2 .venv/bin/python docs/results/engine-process-20261206/ab_heavy.py LABEL 0|1
"""
import os, sys
from loadtest.metrics import summarize
from loadtest.overhead import MODEL_NAME, LocalCluster, server_results
from loadtest.workloads import burst_requests
from workers.model_loader import load_tokenizer

label, ep = sys.argv[1], sys.argv[2] == "1"
model = sys.argv[3] if len(sys.argv) > 3 else "/tmp/tiny-fast"
stream = (sys.argv[4] != "0") if len(sys.argv) > 4 else True
requests = burst_requests(load_tokenizer(model), 256)
with LocalCluster(direct_ingress=True) as cluster:
    url = cluster.deploy("s", {"model": model, "dtype": "bfloat16", "engine_process": ep})
    for _ in range(int(os.environ.get("RUNS", "3"))):
        r = summarize(*server_results(url, MODEL_NAME, requests, stream, progress=False))
        print(f"{label} ep={int(ep)} stream={int(stream)} tok/s {r['output_throughput']:.0f} ttft p50 {r['median_ttft_ms']:.0f} "
              f"itl p95 {r['p95_itl_ms']:.1f}", flush=True)
