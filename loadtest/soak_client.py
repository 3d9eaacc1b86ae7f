"""The soak's HTTP side: send each request of the mix to its endpoint, read it to the end (or cut it off
mid-stream on purpose), and sort every request into completed / errored / disconnected / lost, at a fixed
number of requests in flight."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import aiohttp
from tqdm.auto import tqdm

from loadtest.http_client import RequestResult, StreamFailure, error_message, http_error, sse_events
from loadtest.soak_mix import SoakRequest, request_body


class Outcome(str, Enum):
    COMPLETED = "completed"  # a whole, well-formed answer
    ERRORED = "errored"  # the server answered with an error, or a broken answer
    DISCONNECTED = "disconnected"  # we closed the connection mid-stream on purpose
    LOST = "lost"  # no answer at all: no HTTP status, or none finished within the timeout


@dataclass
class SoakResult:
    """One request's outcome; `error_type` groups errors for counting, `timing` holds the client timings."""

    index: int
    outcome: Outcome
    timing: RequestResult
    stream: bool = False
    error_type: str | None = None
    error: str | None = None
    chunks: int = 0


@dataclass
class _Read:
    """What reading one response found."""

    error_type: str | None = None
    error: str | None = None
    disconnected: bool = False
    chunks: int = 0
    finished: set[int] = field(default_factory=set)


def v1_url(url: str, path: str) -> str:
    base = url.rstrip("/")
    return (base if base.endswith("/v1") else base + "/v1") + path


def _delta(choice: dict[str, Any], chat: bool) -> bool:
    """Whether a choice of a response or stream event carries generated text or logprobs."""
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return bool(text or choice.get("logprobs"))


def _check_choices(choices: Any, req: SoakRequest) -> str | None:
    """The problem with a non-streamed response's choices, if any."""
    if not isinstance(choices, list) or sorted(c.get("index", -1) for c in choices) != list(range(req.n)):
        return f"expected choices 0..{req.n - 1}, got {choices!r:.100}"
    if any(not c.get("finish_reason") for c in choices):
        return "a choice has no finish_reason"
    if req.logprobs is not None and any(c.get("logprobs") is None for c in choices):
        return "logprobs were asked for but a choice has none"
    return None


def _apply_usage(timing: RequestResult, usage: dict[str, Any]) -> None:
    timing.output_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:  # chat: the templated prompt, longer than the message
        timing.prompt_tokens = int(usage["prompt_tokens"])


async def _read_body(resp: aiohttp.ClientResponse, req: SoakRequest, timing: RequestResult) -> _Read:
    raw = await resp.read()
    try:
        body = json.loads(raw)
    except ValueError:
        return _Read("invalid JSON", f"invalid JSON response: {raw[:100]!r}")
    if message := error_message(body):
        return _Read("server error", f"server error: {message}")
    if problem := _check_choices(body.get("choices"), req):
        return _Read("bad response", problem)
    usage = body.get("usage") or {}
    if usage.get("completion_tokens") is None:
        return _Read("bad response", "response has no usage.completion_tokens")
    _apply_usage(timing, usage)
    return _Read()


async def _read_stream(resp: aiohttp.ClientResponse, req: SoakRequest, timing: RequestResult) -> _Read:
    """Read SSE events to `[DONE]`; with `disconnect_after`, close the connection after that many chunks."""
    read = _Read()
    usage: dict[str, Any] | None = None
    try:
        async with aclosing(sse_events(resp, timing.start_time)) as events:
            async for t, event in events:
                for choice in event.get("choices") or []:
                    if choice.get("finish_reason"):
                        read.finished.add(int(choice.get("index", 0)))
                    if _delta(choice, req.chat) or choice.get("finish_reason"):
                        read.chunks += 1
                if any(_delta(c, req.chat) for c in event.get("choices") or []):
                    timing.record_arrival(t)
                usage = event.get("usage") or usage
                if req.disconnect_after is not None and read.chunks >= req.disconnect_after:
                    resp.close()
                    read.disconnected = True
                    return read
    except StreamFailure as e:
        return _Read(e.kind, str(e))
    if read.finished != set(range(req.n)):
        return _Read("bad response", f"finish_reason for choices {sorted(read.finished)}, expected 0..{req.n - 1}")
    if not usage or usage.get("completion_tokens") is None:
        return _Read("bad response", "stream has no usage.completion_tokens")
    _apply_usage(timing, usage)
    return read


async def send_soak_request(session: aiohttp.ClientSession, url: str, model: str, req: SoakRequest, *,
                            api_key: str | None, timeout_s: float) -> SoakResult:
    """Send one request and sort its outcome; never raises."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timing = RequestResult(success=False, prompt_tokens=len(req.prompt_token_ids), start_time=time.perf_counter())
    result = SoakResult(req.index, Outcome.LOST, timing, stream=req.stream)
    try:
        async with session.post(v1_url(url, req.path), json=request_body(req, model), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            timing.status = resp.status
            if not 200 <= resp.status < 300:
                read = _Read(f"HTTP {resp.status}", await http_error(resp))
            elif req.stream:
                read = await _read_stream(resp, req, timing)
            else:
                read = await _read_body(resp, req, timing)
    except TimeoutError:
        read = _Read("timeout", f"no answer within {timeout_s:g} s")
    except Exception as exc:  # noqa: BLE001 - every failure must become a result
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        cut = timing.status is not None and isinstance(exc, aiohttp.ClientError)  # the answer had begun
        read = _Read("stream cut" if cut else type(exc).__name__, message)
    timing.latency = time.perf_counter() - timing.start_time
    result.chunks, result.error_type, result.error = read.chunks, read.error_type, read.error
    if read.disconnected:
        result.outcome = Outcome.DISCONNECTED
    elif read.error_type is None:
        result.outcome = Outcome.COMPLETED
    elif timing.status is not None and read.error_type != "timeout":
        result.outcome = Outcome.ERRORED
    timing.success = result.outcome is Outcome.COMPLETED
    timing.error = read.error
    return result


async def run_soak_load(url: str, model: str, requests: list[SoakRequest], *, concurrency: int,
                        api_key: str | None = None, timeout_s: float = 120.0, progress: bool = True,
                        desc: str = "soak") -> tuple[list[SoakResult], float]:
    """Send `requests` with `concurrency` in flight (a new one as soon as one ends); results in request
    order and the wall seconds."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: list[SoakResult | None] = [None] * len(requests)
    queue = iter(range(len(requests)))
    bar = tqdm(total=len(requests), disable=not progress, unit="req", desc=desc)
    counts = {o: 0 for o in Outcome}

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def worker() -> None:
            for i in queue:
                res = await send_soak_request(session, url, model, requests[i], api_key=api_key, timeout_s=timeout_s)
                results[i] = res
                counts[res.outcome] += 1
                bar.update(1)
                if counts[Outcome.ERRORED] or counts[Outcome.LOST]:
                    bar.set_postfix(errored=counts[Outcome.ERRORED], lost=counts[Outcome.LOST], refresh=False)

        try:
            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        finally:
            bar.close()
        duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration
