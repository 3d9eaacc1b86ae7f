"""The `kvrelay` command line: flags generated from the option dataclasses, and `kvrelay serve` as a user
runs it (its own local Ray cluster, a ready line with the URL, Ctrl-C drains and stops it and removes
the cluster's temp dir)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http.client as http_client
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import APP_KV_MEMORY
from serving_helpers import http, listener, sockets_on

from serving import direct_ingress
from serving.app_config import AppConfig
from serving.cli import (add_app_options, add_engine_options, app_config_from_args, engine_config_from_args,
                         flag_options, main)
from serving.ray_cluster import SERVE_CONTROL_LOOP_INTERVAL_S, check_port_free, free_port, prepare_ray_env
from workers.config import EngineConfig, parse_memory

KVRELAY = Path(sys.executable).with_name("kvrelay")
ROOT = Path(__file__).resolve().parents[2]


def _kinds(annotation: Any) -> set[type]:
    return set(typing.get_args(annotation) or (annotation,)) - {type(None)}


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    return parser


def test_every_engine_option_is_a_flag_with_its_type_and_default():
    parser = _engine_parser()
    defaults = vars(parser.parse_args([]))
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        assert defaults[f.name] == f.default, f.name
        flag, kinds = "--" + f.name.replace("_", "-"), _kinds(hints[f.name])
        if kinds == {bool}:
            assert getattr(parser.parse_args([flag]), f.name) is True
            assert getattr(parser.parse_args(["--no-" + flag[2:]]), f.name) is False
        elif kinds in ({int}, {float}):
            assert getattr(parser.parse_args([flag, "7"]), f.name) == 7
            with pytest.raises(SystemExit):
                parser.parse_args([flag, "seven"])
        else:
            assert str in kinds, f"{f.name}: {hints[f.name]}"  # a string, parsed by EngineConfig when not str
            assert getattr(parser.parse_args([flag, "7GiB"]), f.name) == "7GiB"


def test_engine_flags_build_the_config():
    args = _engine_parser().parse_args(["--max-num-seqs", "8", "--kv-cache-memory", "512MiB", "--max-model-len",
                                         "1024", "--no-enable-prefix-caching", "--scheduling-policy", "sjf"])
    config = engine_config_from_args(args)
    assert (config.max_num_seqs, config.max_model_len, config.scheduling_policy) == (8, 1024, "sjf")
    assert parse_memory(config.kv_cache_memory) == 512 << 20 and config.enable_prefix_caching is False
    with pytest.raises(ValueError, match="memory size"):
        engine_config_from_args(_engine_parser().parse_args(["--kv-cache-memory", "lots"]))


def test_every_app_option_is_a_flag_with_its_default():
    parser = argparse.ArgumentParser()
    add_app_options(parser)
    defaults = vars(parser.parse_args([]))
    for name, f in AppConfig.model_fields.items():
        if name != "engine":
            assert defaults[name] == f.get_default(call_default_factory=True), name
    args = parser.parse_args(["--max-waiting-requests", "5", "--target-ongoing-requests", "2.5", "--disaggregate",
                              "--prefill-engine", '{"max_num_seqs": 4}'])
    assert (args.max_waiting_requests, args.target_ongoing_requests, args.disaggregate) == (5, 2.5, True)
    assert args.prefill_engine == '{"max_num_seqs": 4}'  # JSON, parsed into AppConfig


def test_serve_flags_become_one_app_config_that_builds_the_app():
    from serving.app import build_app

    parser = _engine_parser()
    add_app_options(parser)
    args = parser.parse_args(["--max-num-seqs", "8", "--disaggregate", "--prefill-engine", '{"max_num_seqs": 4}',
                              "--decode-max-replicas", "3", "--api-key", "k"])
    config = app_config_from_args(args)
    assert config.engine.max_num_seqs == 8 and config.api_key == "k"
    assert config.pool_engine("prefill").max_num_seqs == 4 and config.pool_engine("decode").max_num_seqs == 8
    build_app(config)
    with pytest.raises(ValueError, match="max_replicas"):
        app_config_from_args(parser.parse_args(["--min-replicas", "3", "--max-replicas", "2"]))


def test_serve_rejects_bad_options_before_starting_ray(capsys):
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be a positive integer" in capsys.readouterr().err
    assert main(["serve", "--prefill-engine", '{"max_num_seq": 4}', "--disaggregate"]) == 2
    assert "unknown prefill_engine option(s): max_num_seq" in capsys.readouterr().err


def test_serve_refuses_a_port_in_use_before_starting_ray(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err


def _port_in_time_wait() -> int:
    """A port that nothing listens on, held by a connection in TIME_WAIT (its server closed it first)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own listener (the proxy's)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = listener.accept()
            conn.close()
            client.recv(1)  # the server's FIN
    return port


def test_a_port_held_by_a_closed_connection_is_free_for_the_proxy_only():
    port = _port_in_time_wait()
    check_port_free("127.0.0.1", port)  # Serve's proxy binds with SO_REUSEADDR
    with pytest.raises(ValueError, match="connections closed within the last minute"):
        check_port_free("127.0.0.1", port, reuse_addr=False)


def test_a_direct_ingress_replica_binds_its_port_reusing_the_address(monkeypatch):
    """Serve's own replica code, as Ray 2.60 has it, refuses a port held by a closed connection; after
    `bind_reusing_address` it binds it (SO_REUSEADDR, not SO_REUSEPORT), serves on it, and still refuses a
    port that another socket listens on."""
    from fastapi import FastAPI
    from ray.serve._private import http_util, replica
    from ray.serve.config import HTTPOptions

    monkeypatch.setattr(replica, "start_asgi_http_server", replica.start_asgi_http_server)  # undone after the test
    monkeypatch.setattr(http_util, "set_socket_reuse_port", http_util.set_socket_reuse_port)
    app = FastAPI()
    app.get("/ping")(lambda: {"pong": True})

    async def serve_once(port: int) -> dict:
        loop = asyncio.get_running_loop()
        task, server = await replica.start_asgi_http_server(app, HTTPOptions(host="127.0.0.1", port=port),
                                                            event_loop=loop, enable_so_reuseport=False)
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            sock = server.servers[0].sockets[0]
            body = await asyncio.to_thread(http, "GET", f"http://127.0.0.1:{port}/ping", timeout=10)
            return {"reuse_addr": bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)),
                    "reuse_port": bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)), "body": body}
        finally:
            server.should_exit = True
            await task

    port = _port_in_time_wait()
    with pytest.raises(RuntimeError, match="Failed to bind"):  # Ray's replica, unchanged
        asyncio.run(serve_once(port))
    assert direct_ingress.can_bind_reusing_address()
    assert direct_ingress.bind_reusing_address() and direct_ingress.bind_reusing_address()  # idempotent
    assert asyncio.run(serve_once(port)) == {"reuse_addr": True, "reuse_port": False, "body": (200, {"pong": True})}
    with socket.socket() as other:  # a live listener still holds the port
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(RuntimeError, match="Failed to bind"):
            asyncio.run(serve_once(other.getsockname()[1]))


def test_a_local_cluster_runs_serves_control_loop_less_often_unless_told(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "")  # so that the test's changes are undone
    monkeypatch.delenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S")
    prepare_ray_env(local=False)  # a cluster we join keeps its own settings
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in os.environ
    prepare_ray_env(local=True)
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == SERVE_CONTROL_LOOP_INTERVAL_S == "0.25"
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")
    prepare_ray_env(local=True)
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


def test_direct_ingress_is_refused_where_it_cannot_serve(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = str(free_port())
    assert main(["serve", "--port", port, "--direct-ingress", "--max-replicas", "2"]) == 2
    assert "--direct-ingress needs the engine in the ingress's one replica" in capsys.readouterr().err
    assert main(["serve", "--port", port, "--direct-ingress", "--no-engine-in-ingress"]) == 2
    assert "--direct-ingress needs the engine in the ingress's one replica" in capsys.readouterr().err
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert main(["serve", "--direct-ingress"]) == 2
    assert "cannot join the cluster at RAY_ADDRESS" in capsys.readouterr().err
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in os.environ  # nothing was set for a Ray that did not start


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_shows_every_default(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")  # one block per option, help beside or below its flags
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out.split("options:", 1)[1]
    blocks = {"-" + b.split()[0].rstrip(","): " ".join(b.split()) for b in text.split("\n  -")[1:]}
    del blocks["-h"]
    flags = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(EngineConfig)}
    if command == "serve":
        flags |= {f"--{name.replace('_', '-')}" for name in AppConfig.model_fields if name != "engine"}
    assert flags <= set(blocks)
    for block in blocks.values():
        assert "default" in block, block
    if command == "serve":
        assert blocks["--max-waiting-requests"].endswith("(default: 1024)")
        assert "default: max_num_seqs + max_waiting_requests" in blocks["--max-ongoing-requests"]
        assert blocks["--max-request-body-bytes"].endswith(f"(default: {8 << 20})")


def test_served_model_name_takes_several_names_as_in_vllm():
    parser = argparse.ArgumentParser()
    add_app_options(parser)
    args = parser.parse_args(["--served-model-name", "smol", "smol-alias", "--chat-template", "{{ x }}",
                              "--trust-request-chat-template"])
    assert args.served_model_name == ["smol", "smol-alias"] and args.trust_request_chat_template
    config = app_config_from_args(argparse.Namespace(**vars(args), **vars(_engine_parser().parse_args([]))))
    assert config.served_model_name == ["smol", "smol-alias"] and config.chat_template == "{{ x }}"


def test_a_field_type_without_a_flag_form_is_refused():
    assert flag_options("size", int | str) == {"type": str}
    with pytest.raises(TypeError, match="sizes.*command-line"):
        flag_options("sizes", list[int])


def _stream_events(url: str, body: dict, started: threading.Event) -> list[dict]:
    """The data events of one streamed completion, up to `[DONE]`."""
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: "):
                if line[6:].strip() == b"[DONE]":
                    return events
                events.append(json.loads(line[6:]))
                started.set()
    raise AssertionError(f"the stream was cut without [DONE] after {len(events)} events")


class _Phases:
    """Seconds from the start to each phase of a `kvrelay serve` test; a run past `slow_s` (they take ~20 s)
    says where its time went in a warning, with the server's output, so a stall that ends in a pass is seen."""

    def __init__(self, slow_s: float = 90.0) -> None:
        self.start, self.slow_s, self.marks = time.monotonic(), slow_s, {}

    def mark(self, name: str) -> None:
        self.marks[name] = round(time.monotonic() - self.start, 1)

    def warn_if_slow(self, output: str, snapshot: str = "") -> None:
        if max(self.marks.values(), default=0.0) > self.slow_s:
            warnings.warn(f"kvrelay serve test slow: seconds at {self.marks}; its output's end:\n{output[-3000:]}"
                          + (f"\nwhile it started, {SNAPSHOT_AFTER_S:.0f} s in:\n{snapshot}" if snapshot else ""),
                          stacklevel=2)


SNAPSHOT_AFTER_S = 60.0  # a start takes ~15 s


def _ray_temp_dir(lines: list[str]) -> str | None:
    """The Ray temp dir `kvrelay serve` printed, if it has yet."""
    return next((line.split()[3] for line in lines if line.startswith("Ray temp dir:")), None)


def _cluster_snapshot(lines: list[str]) -> str:
    """What a slow start is doing: the busiest processes and the last lines of Serve's and Ray's logs in the
    server's Ray temp dir (removed when it stops)."""
    ps = subprocess.run(["ps", "-eo", "pid,pcpu,rss,etimes,args", "--sort=-pcpu"], capture_output=True, text=True)
    out = [line[:200] for line in ps.stdout.splitlines() if not line.rstrip().endswith("]")][:16]
    temp = _ray_temp_dir(lines)
    logs = Path(temp, "session_latest", "logs") if temp else None
    if logs is not None and logs.is_dir():
        for path in sorted([*logs.glob("serve/*.log"), *logs.glob("worker-*"), logs / "raylet.out"]):
            with contextlib.suppress(OSError):
                tail = [line[:300] for line in path.read_text().splitlines() if "[state-dump]" not in line][-12:]
                if tail:
                    out.append(f"--- {path.relative_to(logs)}\n" + "\n".join(tail))
    return "\n".join(out)


@contextlib.contextmanager
def _kvrelay_serve(port: int, *flags: str):
    """`kvrelay serve` on `port` in a subprocess, as a user starts it, until its ready line: (process, output
    lines so far). Killed on the way out if still running."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code, wherever the console script was installed from
    proc = subprocess.Popen([str(KVRELAY), "serve", "--port", str(port), "--kv-cache-memory", APP_KV_MEMORY,
                             "--max-num-seqs", "8", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, cwd=ROOT)
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        start = time.monotonic()
        deadline, lines, snapshot = start + 300, [""], []
        while "kvrelay is ready" not in lines[-1]:
            assert time.monotonic() < deadline and proc.poll() is None, "kvrelay serve did not become ready"
            if sel.select(timeout=1):
                lines.append(proc.stdout.readline())
            if not snapshot and time.monotonic() - start > SNAPSHOT_AFTER_S:
                snapshot.append(_cluster_snapshot(lines))
        proc.slow_start_snapshot = snapshot[0] if snapshot else ""
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _answers_three_tokens(url: str) -> None:
    status, body = http("POST", f"{url}/v1/completions",
                        {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def _kill_the_replica_mid_stream_and_wait_for_its_replacement(url: str, port: int) -> None:
    """A direct-ingress replica killed mid-stream: the stream is cut, and the dead replica's connections sit in
    TIME_WAIT for a minute; its replacement binds the port anyway (`serving/direct_ingress.py`), as soon as
    Serve has started it, and serves."""
    pid, cmdline = listener(port)
    assert "ServeReplica" in cmdline
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream_events, url, {"model": "SmolLM2-135M-Instruct", "prompt": "Once",
                                                   "max_tokens": 4000, "ignore_eos": True}, started)
        assert started.wait(120)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises((AssertionError, OSError, http_client.HTTPException)):  # cut, without [DONE]
            stream.result(timeout=60)
    assert any(state == "06" for state, _ in sockets_on(port))  # TIME_WAIT: what held Ray's own replica off
    while True:
        try:
            if http("GET", f"{url}/health", timeout=5)[0] == 200:
                break
        except OSError:  # refused while no replica listens
            pass
        assert time.monotonic() - killed < 45, "the port did not serve again within 45 s of the kill"
        time.sleep(0.25)
    assert listener(port)[0] != pid


@pytest.mark.parametrize("direct_ingress", [False, True], ids=["proxy", "direct-ingress"])
def test_kvrelay_serve_starts_answers_drains_on_ctrl_c_and_cleans_up(direct_ingress):
    """A server's life: it starts, answers, (with direct ingress: its replica, killed mid-stream, is replaced
    on its port within seconds and answers,) drains a stream in flight on Ctrl-C, and leaves nothing behind."""
    port = free_port()
    phases = _Phases()
    # Direct ingress is the default here (a local cluster, the engine in the ingress's one replica).
    with _kvrelay_serve(port, *([] if direct_ingress else ["--no-direct-ingress"])) as (proc, lines):
        phases.mark("ready")
        temp_dir = Path(_ray_temp_dir(lines))
        assert temp_dir.is_dir()
        url = f"http://127.0.0.1:{port}"
        assert f"{url}/v1" in lines[-1]
        # Behind Serve's proxy, or the engine's replica itself with direct ingress.
        assert ("ServeReplica" if direct_ingress else "ProxyActor") in listener(port)[1]
        _answers_three_tokens(url)
        phases.mark("first_completion")
        if direct_ingress:
            _kill_the_replica_mid_stream_and_wait_for_its_replacement(url, port)
            phases.mark("replaced")
            _answers_three_tokens(url)
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:  # a stream in flight when Ctrl-C comes: it finishes
            stream = pool.submit(_stream_events, url, {"model": "SmolLM2-135M-Instruct", "prompt": "Once", "max_tokens": 32,
                                                       "ignore_eos": True, "stream_options": {"include_usage": True}},
                                 started)
            assert started.wait(120)
            phases.mark("stream_started")
            proc.send_signal(signal.SIGINT)
            events = stream.result(timeout=120)
            phases.mark("stream_done")
        assert all("error" not in e for e in events) and events[-1]["usage"]["completion_tokens"] == 32
        output, _ = proc.communicate(timeout=120)
        phases.mark("exited")
        phases.warn_if_slow("".join(lines) + output, proc.slow_start_snapshot)
        assert proc.returncode == 0 and "draining" in output, output[-2000:]
        with pytest.raises(OSError):  # nothing listens any more
            http("GET", f"{url}/health", timeout=5)
        assert not temp_dir.exists()  # the Ray session's files are gone
