"""Starting or joining Ray for `kvrelay serve` and the tests, with the settings this project needs.

Set before Ray is imported: no usage stats, no token auth (Ray 2.60 turns it on by default and later
runs then need the token), and for a local cluster, loopback only and Serve's control loop every 0.25 s
instead of 0.1 (`SERVE_CONTROL_LOOP_INTERVAL_S`). A local cluster gets a short temp dir (Ray's socket
paths must stay under 108 characters) and no dashboard (the largest start-up cost)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request


# Serve's controller runs its control loop (replica states, autoscaling decisions, a node list from the GCS)
# every 0.1 s by default, which on a 2-core host costs more than anything else in an idle server. Every
# 0.25 s: an idle server used 1.13-1.35 CPU-s in 20 s against 1.47-1.56, the controller 0.34-0.36 CPU-s
# in a burst (cap 256) against 0.58-0.60, and the server was ready as soon (13.1 s); every 0.5 or 1 s saved
# little more and took 1-2 s longer to be ready (docs/benchmarks.md). Set the variable to override.
SERVE_CONTROL_LOOP_INTERVAL_S = "0.25"


def prepare_ray_env(local: bool) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if local:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", SERVE_CONTROL_LOOP_INTERVAL_S)


def init_ray(num_cpus: int | None = None) -> str | None:
    """Join the cluster at `RAY_ADDRESS` if set, else start a private local cluster. Returns the temp
    dir of a local cluster (None when joining)."""
    address = os.environ.get("RAY_ADDRESS") or None
    prepare_ray_env(local=address is None)
    import ray

    if address is not None:
        ray.init(address=address)
        return None
    temp_dir = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
    ray.init(include_dashboard=False, _temp_dir=temp_dir, num_cpus=num_cpus or os.cpu_count(),
             log_to_driver=False, configure_logging=False)
    return temp_dir


def stop_ray(temp_dir: str | None) -> None:
    """Disconnect from Ray (a local cluster stops with it) and remove the local cluster's temp dir, where
    Ray leaves its logs, sockets and session files (about 0.5 MB a run); set KVRELAY_KEEP_RAY_TEMP=1 to
    keep them for a post-mortem."""
    import ray

    ray.shutdown()
    if temp_dir is not None and os.environ.get("KVRELAY_KEEP_RAY_TEMP") != "1":
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_until_healthy(url: str, timeout_s: float = 600.0) -> None:
    """Poll `url/health` until it answers 200 (Serve's proxy answers 404 until the app is up)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | str = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f} s (last: {last})")


def check_port_free(host: str, port: int, reuse_addr: bool = True) -> None:
    """A clear error before Ray starts when `host:port` cannot be bound (Serve's HTTP server would fail later,
    in one of its actors, and less plainly). `reuse_addr` binds as Serve's proxy and kvrelay's direct-ingress
    replica do (SO_REUSEADDR: a recently closed connection's TIME_WAIT does not count); without it, as Ray
    2.60's own direct-ingress replica does (`serving/direct_ingress.py`)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            hint = ("" if reuse_addr else " (with direct ingress on this Ray, connections closed within the last "
                    "minute also hold the port: wait, or use another port)")
            raise ValueError(f"cannot serve on {host}:{port}: {e.strerror or e}{hint}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy_app(name: str, options: dict, base_url: str, timeout_s: float = 600.0) -> str:
    """Run `kvrelay serve`'s application under `/<name>` on a running Serve instance; its URL once healthy."""
    from ray import serve

    from serving.app import build_app

    serve.run(build_app(options), name=name, route_prefix=f"/{name}", blocking=False)
    url = f"{base_url}/{name}"
    wait_until_healthy(url, timeout_s=timeout_s)
    return url
