"""Helpers of the server tests: raw HTTP calls, parsed `/metrics`, and who listens on a port."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path


API_KEY = "test-key"
# The default-model app that several server test files share (deployed once per session as "main").
MAIN_APP_OPTIONS = dict(api_key=API_KEY, max_request_body_bytes=1 << 20, dtype="float32", max_model_len=1024,
                        enable_auto_tool_choice=True, tool_call_parser="hermes")


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None,
         timeout: float = 120) -> tuple[int, dict | str]:
    """A raw HTTP call (no client-side validation): status and parsed JSON (or text)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"Content-Type": "application/json"} if isinstance(body, dict) else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """`/metrics` parsed (`parse_metrics`)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """A Prometheus exposition parsed with prometheus_client: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(samples: dict, name: str, **labels) -> float:
    """Sum of a sample over replicas (and any labels not given)."""
    return sum(v for (n, lbls), v in samples.items()
               if n == name and all(dict(lbls).get(k) == val for k, val in labels.items()))


def listener(port: int) -> tuple[int, str]:
    """The pid and command line of the process that listens on 127.0.0.1:`port` (TCP)."""
    inodes = {f"socket:[{inode}]" for state, inode in sockets_on(port) if state == "0A"}  # LISTEN
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
                return int(fd_dir.parent.name), (fd_dir.parent / "cmdline").read_text().replace("\0", " ")
        except OSError:  # a process that ended, or one of another user
            continue
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def sockets_on(port: int) -> list[tuple[str, str]]:
    """(state, inode) of the TCP sockets whose local address is 127.0.0.1:`port` (`/proc/net/tcp`'s hex
    states: 0A LISTEN, 06 TIME_WAIT)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [(f[3], f[9]) for f in rows if f[1] == f"0100007F:{port:04X}"]
