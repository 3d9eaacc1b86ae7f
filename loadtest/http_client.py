"""Async load generator for any OpenAI-compatible ``/v1/completions`` server.

Requests are sent with token-id prompts and ``ignore_eos`` so output lengths are
forced; streamed responses give per-request TTFT and inter-token latencies.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from loadtest.workloads import BenchRequest


@dataclass
class RequestResult:
    """Outcome and client-side timings of one request (times in seconds)."""

    success: bool
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    start_time: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    latency: float = 0.0
    status: int | None = None

    def record_arrival(self, t: float) -> None:
        """Note a content chunk arriving ``t`` s after start (k tokens in one chunk = one arrival)."""
        if self.ttft is None:
            self.ttft = t
        else:
            self.itl.append(t - self.token_times[-1])
        self.token_times.append(t)


class SSELineBuffer:
    """Reassembles complete lines from network chunks that may split lines anywhere."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        """Add ``data``; return the lines it completed, without line endings."""
        *lines, self._pending = (self._pending + data).split(b"\n")
        return [_decode_line(line) for line in lines]

    def flush(self) -> list[str]:
        """Return the unterminated last line, if any (server closed without a newline)."""
        rest, self._pending = self._pending, b""
        return [_decode_line(rest)] if rest.strip() else []


def _decode_line(line: bytes) -> str:
    return line.rstrip(b"\r").decode("utf-8", errors="replace")


def sse_data(line: str) -> str | None:
    """Payload of an SSE ``data:`` line, or None for comments, blank lines and other fields."""
    if not line.startswith("data:"):
        return None
    payload = line[5:]
    return payload[1:] if payload.startswith(" ") else payload


def completions_url(url: str) -> str:
    """``{url}/v1/completions``; a base URL already ending in ``/v1`` is accepted too."""
    base = url.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


def arrival_schedule(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from start) for ``n`` requests: the first at 0, then cumulative gamma gaps.

    Gaps have shape ``burstiness`` and scale ``1/(rate*burstiness)``, so their mean is
    ``1/rate`` (burstiness 1 = Poisson, < 1 burstier). ``rate=inf`` sends all at 0.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def _payload(model: str, req: BenchRequest, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(req.prompt_token_ids),
        "max_tokens": req.output_len,
        **req.sampling_options(),
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def error_message(body: Any) -> str | None:
    """The message of an OpenAI-style error object (``{"error": ...}`` or ``{"object": "error"}``)."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if err:
        return str(err)
    if body.get("object") == "error":
        return str(body.get("message") or body)
    return None


def _has_token(event: dict[str, Any]) -> bool:
    """Whether a stream event carries generated content (text or token ids/logprob tokens)."""
    choices = event.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    logprobs = choice.get("logprobs") or {}
    return bool(choice.get("text") or choice.get("token_ids") or logprobs.get("tokens"))


def _apply_usage(result: RequestResult, usage: dict[str, Any] | None) -> str | None:
    """Copy token counts from ``usage``; return an error if they are missing."""
    if not isinstance(usage, dict) or usage.get("completion_tokens") is None:
        return "response has no usage.completion_tokens"
    result.output_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        result.prompt_tokens = int(usage["prompt_tokens"])
    return None


async def http_error(resp: aiohttp.ClientResponse) -> str:
    """`HTTP <status>: <message>` of an error response, from its OpenAI-style body when it has one."""
    text = await resp.text(errors="replace")
    try:
        message = error_message(json.loads(text))
    except ValueError:
        message = None
    return f"HTTP {resp.status}: {message or text.strip()[:200] or resp.reason}"


class StreamFailure(Exception):
    """A streamed answer that broke; `kind` groups failures for counting ("invalid JSON", "stream error",
    "stream cut")."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def sse_events(resp: aiohttp.ClientResponse, start_time: float) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """The JSON events of a streamed answer up to `data: [DONE]`, each with its network chunk's arrival time
    (s after `start_time`, a `time.perf_counter()` reading); the body is read to its end. Raises
    `StreamFailure` for an event that is not JSON, an error event, or an end before `[DONE]`. A caller that
    stops early (to disconnect) closes it with `contextlib.aclosing`."""
    lines = SSELineBuffer()
    events, done = 0, False

    def parse(data: str) -> dict[str, Any]:
        try:
            event = json.loads(data)
        except ValueError:
            raise StreamFailure("invalid JSON", f"invalid JSON in SSE event: {data[:100]!r}") from None
        if message := error_message(event):
            raise StreamFailure("stream error", f"server error in stream: {message}")
        return event

    eof = False
    chunks = resp.content.iter_any()
    while not eof:
        try:
            batch = lines.feed(await chunks.__anext__())
        except StopAsyncIteration:
            batch, eof = lines.flush(), True
        t = time.perf_counter() - start_time
        for line in batch:
            data = sse_data(line)
            if data is None or done:
                continue
            if data.strip() == "[DONE]":
                done = True
                continue
            events += 1
            yield t, parse(data)
    if not done:
        raise StreamFailure("stream cut", f"stream ended without data: [DONE] after {events} events")


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult) -> str | None:
    """Consume the SSE stream, recording chunk arrival times; return an error or None."""
    usage: dict[str, Any] | None = None
    try:
        async for t, event in sse_events(resp, result.start_time):
            if _has_token(event):
                result.record_arrival(t)
            usage = event.get("usage") or usage
    except StreamFailure as e:
        return str(e)
    return _apply_usage(result, usage)


async def _read_body(resp: aiohttp.ClientResponse, result: RequestResult) -> str | None:
    """Parse a non-streamed response; its whole text arrives at once, so TTFT = latency."""
    raw = await resp.read()
    t = time.perf_counter() - result.start_time
    try:
        body = json.loads(raw)
    except ValueError:
        return f"invalid JSON response: {raw[:100]!r}"
    message = error_message(body)
    if message:
        return f"server error: {message}"
    if _has_token(body):
        result.record_arrival(t)
    return _apply_usage(result, body.get("usage"))


async def send_completion(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    req: BenchRequest,
    *,
    stream: bool,
    api_key: str | None,
    timeout_s: float,
) -> RequestResult:
    """Send one completion request and time it; failures come back as ``success=False``, never raised."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult(success=False, prompt_tokens=len(req.prompt_token_ids),
                           expected_output_tokens=req.output_len, start_time=time.perf_counter())
    try:
        async with session.post(completions_url(url), json=_payload(model, req, stream), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            result.status = resp.status
            if not 200 <= resp.status < 300:
                result.error = await http_error(resp)
            elif stream:
                result.error = await _read_stream(resp, result)
            else:
                result.error = await _read_body(resp, result)
    except TimeoutError:
        result.error = f"timeout after {timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001 - every failure must become a result
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    result.latency = time.perf_counter() - result.start_time
    result.success = result.error is None
    return result


def _schedule(requests: list[BenchRequest], request_rate: float | None, burstiness: float,
              seed: int) -> list[float]:
    if request_rate is None:
        return [r.arrival_time for r in requests]
    return arrival_schedule(len(requests), request_rate, burstiness, seed)


async def run_load(
    url: str,
    model: str,
    requests: list[BenchRequest],
    *,
    stream: bool = True,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    timeout_s: float = 600,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Replay ``requests`` against the server; return results in request order and wall seconds.

    Without ``request_rate`` each request's own ``arrival_time`` is used; with it, the
    seeded ``arrival_schedule`` replaces them. ``max_concurrency`` caps requests in flight.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    schedule = _schedule(requests, request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    bar = tqdm(total=len(requests), disable=not progress, unit="req", desc="requests")

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if limit is None:
                res = await send_completion(session, url, model, req, stream=stream,
                                            api_key=api_key, timeout_s=timeout_s)
            else:
                async with limit:
                    res = await send_completion(session, url, model, req, stream=stream,
                                                api_key=api_key, timeout_s=timeout_s)
            bar.update(1)
            return res

        try:
            results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, schedule)))
        finally:
            bar.close()
        duration = time.perf_counter() - start
    return list(results), duration
