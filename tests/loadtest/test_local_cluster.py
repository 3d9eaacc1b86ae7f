"""The bench's own `kvrelay serve` (`loadtest.overhead.LocalCluster`), in the layout that `kvrelay serve` uses by
default: the app's replica answers HTTP on the cluster's port itself (Serve's direct ingress), one app after
another. In a subprocess, since it starts a Ray cluster of its own (the test session shares another)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
from conftest import APP_KV_MEMORY
from serving_helpers import http, listener
from loadtest.overhead import LocalCluster

out = {"env_inside": None, "apps": []}
with LocalCluster(direct_ingress=True) as cluster:
    port = int(cluster.base_url.rsplit(":", 1)[1])
    out["env_inside"] = os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS")
    for name in ("first", "second"):  # as a bench run deploys a fresh app per run
        url = cluster.deploy(name, {"kv_cache_memory": APP_KV_MEMORY, "max_num_seqs": 4, "prepack_weights": False})
        status, body = http("POST", f"{url}/v1/completions", {"model": "kvrelay-bench", "prompt": "Hi", "max_tokens": 2})
        out["apps"].append({"url": url[len(cluster.base_url):], "status": status,
                            "tokens": body["usage"]["completion_tokens"], "listener": listener(port)[1]})
        cluster.delete(name)
    try:
        cluster.deploy("split", {"engine_in_ingress": False})
    except ValueError as e:
        out["refused"] = str(e)
out["env_after"] = os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS")
print("RESULT " + json.dumps(out))
"""


def test_the_benchs_server_answers_from_the_apps_replica_one_app_after_another():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_SERVE_ENABLE_DIRECT_INGRESS")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-3000:]
    out = json.loads(line[len("RESULT "):])
    assert out["env_inside"] == "1" and out["env_after"] is None  # the process's environment is restored
    assert [a["url"] for a in out["apps"]] == ["/first", "/second"]
    for app in out["apps"]:
        assert app["status"] == 200 and app["tokens"] == 2
        assert "ServeReplica" in app["listener"], app["listener"]  # not Serve's proxy
    assert "engine in the ingress" in out["refused"]
