"""Fast tests of the HTTP load generator and its metrics against a fake in-process server."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from loadtest.http_client import (
    RequestResult,
    SSELineBuffer,
    arrival_schedule,
    completions_url,
    run_load,
    send_completion,
    sse_data,
)
from loadtest.metrics import format_summary, summarize, tpot
from loadtest.workloads import BenchRequest

CHUNK_GAP_S = 0.005
Handler = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


def chunk_sizes(n: int) -> list[int]:
    """Tokens per streamed chunk for ``n`` output tokens: 1, 2, 1, 2, ... (multi-token chunks)."""
    sizes, left, k = [], n, 0
    while left > 0:
        sizes.append(min(left, 1 + k % 2))
        left -= sizes[-1]
        k += 1
    return sizes


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def usage(body: dict[str, Any]) -> dict[str, int]:
    n_prompt, n_out = len(body["prompt"]), body["max_tokens"]
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def text_chunk(text: str) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}


class FakeServer:
    """Imitates ``/v1/completions`` under several prefixes and tracks requests in flight."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.app = web.Application()
        routes: dict[str, Handler] = {
            "": self.ok, "/bad": self.bad, "/drop": self.drop, "/sse-error": self.sse_error,
            "/no-usage": self.no_usage, "/slow": self.slow, "/split": self.split,
        }
        for prefix, handler in routes.items():
            self.app.router.add_post(f"{prefix}/v1/completions", self.tracked(handler))

    def tracked(self, handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def wrapper(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await handler(request, body)
            finally:
                self.in_flight -= 1
        return wrapper

    async def open_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    async def ok(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if not body["stream"]:
            await asyncio.sleep(CHUNK_GAP_S)
            return web.json_response({"object": "text_completion", "usage": usage(body),
                                      "choices": [{"index": 0, "text": "x" * body["max_tokens"]}]})
        resp = await self.open_stream(request)
        await resp.write(sse(text_chunk("")))
        for size in chunk_sizes(body["max_tokens"]):
            await asyncio.sleep(CHUNK_GAP_S)
            await resp.write(sse(text_chunk("x" * size)))
        await resp.write(sse({"object": "text_completion", "choices": [], "usage": usage(body)}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def split(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = await self.open_stream(request)
        events = [sse(text_chunk("é" * size)) for size in chunk_sizes(body["max_tokens"])]
        events += [sse({"choices": [], "usage": usage(body)}).replace(b"\n", b"\r\n"), b"data: [DONE]"]
        for event in events:
            for i in range(0, len(event), 7):
                await resp.write(event[i : i + 7])
                await asyncio.sleep(0.001)
        await resp.write_eof()
        return resp

    async def bad(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        error = {"object": "error", "message": "server overloaded", "type": "ServiceUnavailable", "code": 503}
        return web.json_response({"error": error}, status=503)

    async def drop(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = await self.open_stream(request)
        await resp.write(sse(text_chunk("x")))
        await asyncio.sleep(CHUNK_GAP_S)
        request.transport.close()
        return resp

    async def sse_error(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = await self.open_stream(request)
        await resp.write(sse(text_chunk("x")))
        await resp.write(sse({"error": {"message": "engine died", "code": 500}}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def no_usage(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = await self.open_stream(request)
        await resp.write(sse(text_chunk("x")))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def slow(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(5)
        return web.json_response({})


@asynccontextmanager
async def serve() -> AsyncIterator[tuple[FakeServer, str]]:
    """Run a ``FakeServer`` on 127.0.0.1 with a free port; yield it and its base URL."""
    server = FakeServer()
    runner = web.AppRunner(server.app, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def requests(n: int, output_len: int = 5, prompt_len: int = 8) -> list[BenchRequest]:
    return [BenchRequest(list(range(prompt_len)), output_len) for _ in range(n)]


async def one_request(path: str, *, stream: bool = True, timeout_s: float = 10,
                      api_key: str | None = None) -> tuple[RequestResult, FakeServer]:
    async with serve() as (server, url), aiohttp.ClientSession() as session:
        result = await send_completion(session, url + path, "m", requests(1)[0], stream=stream,
                                       api_key=api_key, timeout_s=timeout_s)
    return result, server


async def load(path: str = "", n: int = 4, **kw: Any) -> tuple[list[RequestResult], float, FakeServer]:
    async with serve() as (server, url):
        results, duration = await run_load(url + path, "m", kw.pop("reqs", None) or requests(n),
                                           progress=False, timeout_s=10, **kw)
    return results, duration, server


def test_arrival_schedule_is_seeded_and_starts_at_zero() -> None:
    a = arrival_schedule(100, 5.0, 1.0, seed=3)
    assert a == arrival_schedule(100, 5.0, 1.0, seed=3)
    assert a != arrival_schedule(100, 5.0, 1.0, seed=4)
    assert len(a) == 100 and a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert arrival_schedule(5, math.inf) == [0.0] * 5
    assert arrival_schedule(0, 1.0) == []
    for rate, burst in [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)]:
        with pytest.raises(ValueError):
            arrival_schedule(3, rate, burst)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_schedule_mean_gap_matches_rate(burstiness: float) -> None:
    rate = 8.0
    gaps = np.diff(arrival_schedule(20_001, rate, burstiness, seed=0))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)


def test_burstiness_sets_gamma_variance() -> None:
    rate = 2.0
    cv2 = {}
    for b in (0.25, 1.0, 4.0):
        gaps = np.diff(arrival_schedule(20_001, rate, b, seed=1))
        cv2[b] = gaps.var() / gaps.mean() ** 2
        assert cv2[b] == pytest.approx(1 / b, rel=0.15)
    assert cv2[0.25] > 2 * cv2[1.0] > 4 * cv2[4.0]


def test_sse_line_buffer_reassembles_split_lines() -> None:
    data = "data: {\"text\": \"é\"}\r\n\r\n: comment\ndata: [DONE]".encode()
    buf, lines = SSELineBuffer(), []
    for i in range(len(data)):
        lines += buf.feed(data[i : i + 1])
    lines += buf.flush()
    assert lines == ['data: {"text": "é"}', "", ": comment", "data: [DONE]"]
    assert [sse_data(x) for x in lines] == ['{"text": "é"}', None, None, "[DONE]"]
    assert sse_data("data:[DONE]") == "[DONE]"


def test_completions_url() -> None:
    assert completions_url("http://h:1") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/") == "http://h:1/v1/completions"


def test_streaming_request_timings_and_payload() -> None:
    result, server = asyncio.run(one_request("", api_key="sk-test"))
    assert result.success and result.error is None and result.status == 200
    assert (result.prompt_tokens, result.output_tokens, result.expected_output_tokens) == (8, 5, 5)
    assert len(result.token_times) == len(chunk_sizes(5)) == 4 < result.output_tokens
    assert result.token_times == sorted(result.token_times)
    assert result.ttft == result.token_times[0] > 0
    assert result.itl == pytest.approx(np.diff(result.token_times).tolist())
    assert all(gap >= CHUNK_GAP_S * 0.5 for gap in result.itl)
    assert result.token_times[-1] <= result.latency
    body = server.bodies[0]
    assert body == {"model": "m", "prompt": list(range(8)), "max_tokens": 5, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    assert server.headers[0]["Authorization"] == "Bearer sk-test"


def test_events_split_across_network_chunks() -> None:
    result, _ = asyncio.run(one_request("/split"))
    assert result.success, result.error
    assert result.output_tokens == 5 and len(result.token_times) == 4


def test_non_streaming_request() -> None:
    result, server = asyncio.run(one_request("", stream=False))
    assert result.success, result.error
    assert result.output_tokens == 5 and result.prompt_tokens == 8
    assert result.itl == [] and result.ttft is not None and result.ttft <= result.latency
    assert "stream_options" not in server.bodies[0] and "Authorization" not in server.headers[0]


@pytest.mark.parametrize("path, stream, needle", [
    ("/bad", True, "HTTP 503: server overloaded"),
    ("/drop", True, "Error"),
    ("/sse-error", True, "engine died"),
    ("/no-usage", True, "usage"),
    ("/slow", False, "timeout after 0.3 s"),
    ("/missing", True, "HTTP 404"),
])
def test_failures_become_results(path: str, stream: bool, needle: str) -> None:
    result, _ = asyncio.run(one_request(path, stream=stream, timeout_s=0.3))
    assert result.success is False
    assert result.error and needle in result.error
    assert result.latency >= 0 and result.expected_output_tokens == 5


def test_connection_refused_becomes_result() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go() -> RequestResult:
        async with aiohttp.ClientSession() as session:
            return await send_completion(session, f"http://127.0.0.1:{port}", "m", requests(1)[0],
                                         stream=True, api_key=None, timeout_s=5)

    result = asyncio.run(go())
    assert result.success is False and result.status is None and "Connect" in result.error


def test_run_load_respects_max_concurrency() -> None:
    results, duration, server = asyncio.run(load(n=12, max_concurrency=3))
    assert all(r.success for r in results) and len(results) == 12
    assert server.max_in_flight == 3
    assert duration > 0


def test_run_load_without_limit_sends_all_at_once() -> None:
    _, _, server = asyncio.run(load(reqs=requests(12, output_len=20)))
    assert server.max_in_flight == 12


def test_run_load_keeps_request_order_and_arrival_times() -> None:
    reqs = [BenchRequest(list(range(3)), n, at) for n, at in [(4, 0.0), (1, 0.15), (6, 0.05)]]
    results, duration, _ = asyncio.run(load(reqs=reqs))
    assert [r.output_tokens for r in results] == [4, 1, 6]
    t0 = min(r.start_time for r in results)
    for r, req in zip(results, reqs):
        assert r.start_time - t0 >= req.arrival_time - 0.01
    assert duration >= 0.15


def test_request_rate_overrides_arrival_times() -> None:
    reqs = [BenchRequest([1, 2], 2, 30.0) for _ in range(5)]
    results, duration, _ = asyncio.run(load(reqs=reqs, request_rate=math.inf))
    assert all(r.success for r in results) and duration < 5


def test_summary_of_live_run_counts_failures() -> None:
    results, duration, _ = asyncio.run(load("/bad", n=3))
    summary = summarize(results, duration)
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert summary["errors"] == {"HTTP 503: server overloaded": 3}
    assert summary["mean_ttft_ms"] == 0.0
    assert "HTTP 503: server overloaded" in format_summary(summary, "fake")


def hand_made_results() -> list[RequestResult]:
    return [
        RequestResult(True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.2]),
        RequestResult(True, prompt_tokens=20, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.05, 0.4]),
        RequestResult(True, prompt_tokens=30, output_tokens=1, ttft=0.2, latency=0.2),
        RequestResult(False, "HTTP 503: overloaded", prompt_tokens=40, ttft=0.9, latency=5.0, itl=[1.0]),
        RequestResult(False, "HTTP 503: overloaded", prompt_tokens=40, latency=4.0),
    ]


def test_tpot_per_request() -> None:
    r = hand_made_results()
    assert tpot(r[0]) == pytest.approx(0.1)
    assert tpot(r[1]) == pytest.approx(0.2)
    assert tpot(r[2]) is None


def test_summarize_hand_computed() -> None:
    s = summarize(hand_made_results(), duration=2.0)
    expected = {
        "completed": 3, "failed": 2, "duration": 2.0,
        "total_input_tokens": 60, "total_output_tokens": 9,
        "request_throughput": 1.5, "output_throughput": 4.5, "total_token_throughput": 34.5,
        "mean_ttft_ms": 200.0, "median_ttft_ms": 200.0, "std_ttft_ms": math.sqrt(20000 / 3),
        "p90_ttft_ms": 280.0, "p95_ttft_ms": 290.0, "p99_ttft_ms": 298.0,
        "mean_tpot_ms": 150.0, "median_tpot_ms": 150.0, "std_tpot_ms": 50.0,
        "p90_tpot_ms": 190.0, "p95_tpot_ms": 195.0, "p99_tpot_ms": 199.0,
        "mean_itl_ms": 170.0, "median_itl_ms": 100.0, "std_itl_ms": math.sqrt(15600),
        "p90_itl_ms": 320.0, "p95_itl_ms": 360.0, "p99_itl_ms": 392.0,
        "mean_e2el_ms": 1400 / 3, "median_e2el_ms": 500.0, "std_e2el_ms": math.sqrt(1140000 / 27),
        "p90_e2el_ms": 660.0, "p95_e2el_ms": 680.0, "p99_e2el_ms": 696.0,
        "errors": {"HTTP 503: overloaded": 2},
    }
    assert s.keys() == expected.keys()
    for key, value in expected.items():
        assert s[key] == pytest.approx(value), key


def test_error_kinds_are_capped_at_ten() -> None:
    results = [RequestResult(False, f"error {i % 12}") for i in range(24)]
    s = summarize(results, 1.0)
    assert s["failed"] == 24
    assert s["errors"] == {f"error {i}": 2 for i in range(10)}


def test_summarize_with_zero_duration_and_no_results() -> None:
    s = summarize([], 0.0)
    assert s["completed"] == s["failed"] == 0 and s["request_throughput"] == 0.0
    assert s["p99_itl_ms"] == 0.0 and s["errors"] == {}


def test_format_summary_layout() -> None:
    text = format_summary(summarize(hand_made_results(), 2.0), "Serving Benchmark Result")
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for needle in ["Successful requests:", "Failed requests:", "Mean TTFT (ms):", "P99 ITL (ms):",
                   "Median TPOT (ms):", "P95 E2EL (ms):", "Output token throughput (tok/s):",
                   "Time per Output Token (excl. 1st token)", "HTTP 503: overloaded"]:
        assert needle in text, needle
    assert "200.00" in next(line for line in lines if line.startswith("Mean TTFT (ms):"))
