"""Streamed burst (256 requests, 128-token prompts, outputs up to 256 tokens) through `kvrelay serve`'s app on
the tiny fast model (docs/results/streams-20261206/ab_stream.py says how to write it to /tmp/tiny-fast), the
engine in the ingress's process (arg 0) or in a child process (arg 1: `engine_process`, at 9e14fee; taken out
after). The load comes from `lightclient.py` (raw sockets; only each stream's last event parsed), so that it leaves the server most of the two cores.

    git checkout 9e14fee
    PYTHONPATH=. .venv/bin/python docs/results/engine-process-20261206/ab_light.py LABEL 0|1
    # a GPU-like engine: its forward sleeps 2 ms with the GIL released and returns fixed logits
    PYTHONPATH=.:docs/results/engine-process-20261206/standin KVRELAY_STANDIN_MS=2 .venv/bin/python docs/results/engine-process-20261206/ab_light.py LABEL 0|1
"""
import asyncio, os, sys
sys.path.insert(0, "docs/results/engine-process-20261206")
from lightclient import burst
from loadtest.overhead import MODEL_NAME, LocalCluster
from loadtest.workloads import burst_requests
from workers.model_loader import load_tokenizer

label, ep = sys.argv[1], sys.argv[2] == "1"
model = "/tmp/tiny-fast"
stream = os.environ.get("STREAM", "1") == "1"
requests = burst_requests(load_tokenizer(model), 256)
with LocalCluster(direct_ingress=True) as cluster:
    url = cluster.deploy("s", {"model": model, "dtype": "bfloat16", "engine_process": ep})
    asyncio.run(burst(url, MODEL_NAME, requests[:2], stream))
    for _ in range(int(os.environ.get("RUNS", "5"))):
        tps, events = asyncio.run(burst(url, MODEL_NAME, requests, stream))
        print(f"{label} ep={int(ep)} stream={int(stream)} standin={os.environ.get('KVRELAY_STANDIN_MS')} tok/s {tps:.0f} events {events}", flush=True)
