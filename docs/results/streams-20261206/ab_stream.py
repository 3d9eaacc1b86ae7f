"""Streamed burst (256 requests, 128-token prompts, outputs up to 256 tokens) through `kvrelay serve`'s app on a
tiny random-weight model, whose engine makes tokens fast enough on a CPU (~9-12k tok/s in-process) for the
replica's per-chunk work to show, as a GPU's engine would. Three runs against one deployment.

    # the model: 2 layers, hidden 64, SmolLM2's tokenizer and vocabulary (tests/conftest.py's write_tiny_model)
    PYTHONPATH=.:tests .venv/bin/python -c "from conftest import write_tiny_model; \
        from workers.model_loader import default_model_path; from pathlib import Path; write_tiny_model( \
        Path('/tmp/tiny-fast'), default_model_path(), hidden_size=64, intermediate_size=128, \
        num_attention_heads=2, num_key_value_heads=1)"
    PYTHONPATH=. .venv/bin/python docs/results/streams-20261206/ab_stream.py LABEL [MODEL]

Serve reads RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD as a replica's process starts; before it was in the app's
options (serving/app_config.py, SERVE_REPLICA_ENV) the A/B set it in this script's environment, which the
local cluster it starts passes on to the replicas."""

import sys

from loadtest.metrics import summarize
from loadtest.overhead import MODEL_NAME, LocalCluster, server_results
from loadtest.workloads import burst_requests
from workers.model_loader import load_tokenizer

label, model = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "/tmp/tiny-fast")
requests = burst_requests(load_tokenizer(model), 256)
with LocalCluster(direct_ingress=True) as cluster:  # as `kvrelay serve` runs by default
    url = cluster.deploy("s", {"model": model, "dtype": "bfloat16"})
    for _ in range(3):
        r = summarize(*server_results(url, MODEL_NAME, requests, True, progress=False))
        print(f"{label} stream tok/s {r['output_throughput']:.0f} ttft p50 {r['median_ttft_ms']:.0f} "
              f"itl p95 {r['p95_itl_ms']:.1f}", flush=True)
