"""`kvrelay serve` as a user runs it: its own local Ray cluster, a ready line with the URL, Ctrl-C stops it."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving_helpers import http

from serving.ray_cluster import free_port

KVRELAY = Path(sys.executable).with_name("kvrelay")


def test_kvrelay_serve_starts_answers_and_stops_on_ctrl_c():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([str(KVRELAY), "serve", "--port", str(port), "--kv-cache-memory", "256MiB",
                             "--max-num-seqs", "8"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            text=True)
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline, ready = time.monotonic() + 300, ""
        while "ready" not in ready:
            assert time.monotonic() < deadline and proc.poll() is None, "kvrelay serve did not become ready"
            if sel.select(timeout=1):
                ready = proc.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        assert f"{url}/v1" in ready
        status, body = http("POST", f"{url}/v1/completions",
                            {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        with pytest.raises(OSError):  # nothing listens any more
            http("GET", f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
