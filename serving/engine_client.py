"""The ingress side of the streaming protocol in `workers/deployment.py`.

`EngineClient.generate` sends one request and yields its per-step deltas. The deltas of all requests on
one replica arrive on a single subscriber stream per replica and are fanned out here to per-request
queues. A replica that dies ends its requests with `EngineError`, never a hang; a request no replica
takes within `replica_wait_timeout_s` gets 503; a replica that stops (scale-down, redeploy) keeps its
requests for `drain_timeout_s`, then they end with an error (the replica counts from when Serve began
stopping it; the ingress, as a fallback, from when its router dropped the replica)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from ray.serve import context as serve_context
from ray.serve.handle import DeploymentHandle

from router.registry import known_replica_ids
from workers.messages import Accepted, GenerateRequest, Rejected, StepBatch
from workers.outputs import RequestOutput, merge_deltas
from workers.replica_drain import DRAIN_POLL_S, ReplicaStopping

logger = logging.getLogger(__name__)


def call(method, *args, **kwargs):
    """`method.remote(*args, **kwargs)` with its own internal request id. Serve's router hands a chosen
    replica to the pending call with the matching internal id, and every call made while serving one HTTP
    request inherits that request's id, so concurrent calls from one handler would be mismatched (pinned
    calls then spin forever)."""
    def remote():
        serve_context._set_request_context(_internal_request_id=uuid.uuid4().hex)
        return method.remote(*args, **kwargs)

    return contextvars.copy_context().run(remote)


async def awaited(response):
    """A handle call's result as a coroutine (for `asyncio.wait_for`, which wants one)."""
    return await response


class EngineError(Exception):
    """A request could not be served; `status` is the HTTP status to answer with (`type` None: the one
    `serving/errors.py` names for it), `retry_after` the seconds a busy replica asks the client to wait
    before retrying."""

    def __init__(self, message: str, status: int = 503, type: str | None = "service_unavailable",
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.retry_after = message, status, type, retry_after


@dataclass(slots=True)
class _Ticket:
    """A prefill replica's KV transfer ticket, queued just before the request's final output."""

    ticket: Any


class _Subscription:
    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.requests: set[str] = set()
        self.task: asyncio.Task | None = None
        self.stream: Any = None
        self.drain_deadline: float | None = None  # set once the replica has left the router's set
        self.cut = False


class RequestStream:
    """Async iterator over one request's deltas. `close()` before the end aborts the request."""

    def __init__(self, client: EngineClient, request_id: str, queue: asyncio.Queue, stream, sub: _Subscription,
                 watcher: asyncio.Task) -> None:
        self.request_id = request_id
        self._client, self._queue, self._stream, self._sub, self._watcher = client, queue, stream, sub, watcher
        self.finished = False
        self._closed = False
        self.replica_id = sub.replica_id
        self.kv_ticket: Any = None
        self._held: EngineError | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next delta; deltas already queued behind it (a consumer behind the engine: a batch of requests
        each streamed by Python at a GPU's rate) come as one, so that the chunks a request is sent, and the
        work for each, keep to what its consumer can take (vLLM merges alike)."""
        if self.finished or self._closed:
            raise StopAsyncIteration
        item, self._held = self._held, None
        if item is None:
            item = await self._queue.get()
        while isinstance(item, _Ticket):
            self.kv_ticket = item.ticket
            item = await self._queue.get()
        if isinstance(item, EngineError):
            self.close()
            raise item
        while not item.finished and not self._queue.empty():
            later = self._queue.get_nowait()
            if isinstance(later, _Ticket):
                self.kv_ticket = later.ticket
            elif isinstance(later, EngineError):
                self._held = later  # raised by the next call, after what came before it
                break
            else:
                item = merge_deltas(item, later)
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client._queues.pop(self.request_id, None)
        self._client._request_done(self._sub, self.request_id)
        self._watcher.cancel()
        if not self.finished:
            self._stream.cancel()


class EngineClient:
    watch_draining = True  # see `_watch_draining`

    def __init__(self, handle: DeploymentHandle | None, replica_wait_timeout_s: float | None = None,
                 drain_timeout_s: float = 30.0) -> None:
        self._handle = handle.options(stream=True) if handle is not None else None
        self.deployment = handle.deployment_name if handle is not None else None
        self.subscriber_id = uuid.uuid4().hex
        self.replica_wait_timeout_s, self.drain_timeout_s = replica_wait_timeout_s, drain_timeout_s
        self._queues: dict[str, asyncio.Queue] = {}
        self._subscriptions: dict[str, _Subscription] = {}
        self._drain_watch: asyncio.Task | None = None

    async def submit(self, request: GenerateRequest) -> RequestStream:
        """Send one request; returns once a replica has accepted it. Raises `EngineError` if it is refused
        (queue full: 429) or no replica can take it."""
        rid = request.request_id
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        stream = self._open_generate(request)
        try:
            first = await asyncio.wait_for(stream.__anext__(), self.replica_wait_timeout_s)
        except BaseException as e:
            self._queues.pop(rid, None)
            stream.cancel()
            if isinstance(e, asyncio.CancelledError):
                raise
            if isinstance(e, asyncio.TimeoutError):
                raise self._no_replica_error() from None
            raise EngineError(f"the engine replica failed before accepting the request: {_describe(e)}") from e
        if not isinstance(first, Accepted):
            self._queues.pop(rid, None)
            if isinstance(first, Rejected):
                raise EngineError(first.message, first.status, first.type, first.retry_after)
            raise EngineError(f"unexpected first message from the engine replica: {first!r}", 500, "internal_error")
        sub = self._subscribe(first.replica_id)
        sub.requests.add(rid)
        watcher = asyncio.create_task(self._watch(stream, queue))
        return RequestStream(self, rid, queue, stream, sub, watcher)

    def _open_generate(self, request: GenerateRequest):
        return call(self._handle.generate, self.subscriber_id, request)

    def _open_subscribe(self, replica_id: str):
        return call(self._handle.subscribe, self.subscriber_id, replica_id=replica_id)

    async def _watch(self, stream, queue: asyncio.Queue) -> None:
        """The generate stream stays open until the request ends; if it fails, the replica is gone."""
        try:
            async for _ in stream:
                pass
        except asyncio.CancelledError:
            raise
        except ReplicaStopping as e:  # raised on the replica; Ray's wrapper keeps it as `cause`
            queue.put_nowait(EngineError(str(getattr(e, "cause", e))))
        except Exception as e:
            queue.put_nowait(EngineError(f"the engine replica serving this request failed: {_describe(e)}"))

    def _no_replica_error(self) -> EngineError:
        return EngineError(f"no {self.deployment} replica accepted the request within {self.replica_wait_timeout_s:g} s "
                           "(replica_wait_timeout_s): none is ready (starting, or replacing one that failed) or all "
                           "are busy; retry later")

    def _subscribe(self, replica_id: str) -> _Subscription:
        sub = self._subscriptions.get(replica_id)
        if sub is None:
            sub = self._subscriptions[replica_id] = _Subscription(replica_id)
            sub.task = asyncio.create_task(self._pump(sub))
        if self.watch_draining and (self._drain_watch is None or self._drain_watch.done()):
            self._drain_watch = asyncio.create_task(self._watch_draining())
        return sub

    async def _pump(self, sub: _Subscription) -> None:
        stream = sub.stream = self._open_subscribe(sub.replica_id)
        error: Exception | None = None
        try:
            async for batch in stream:
                if isinstance(batch, StepBatch):
                    self._fan_out(batch)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:
            error = e
            logger.warning("subscriber stream to replica %s ended: %s", sub.replica_id, _describe(e))
        finally:
            if self._subscriptions.get(sub.replica_id) is sub:
                del self._subscriptions[sub.replica_id]
        message = f"lost the stream from engine replica {sub.replica_id}: {_describe(error) if error else 'closed'}"
        for rid in list(sub.requests):
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(EngineError(message))

    def _fan_out(self, batch: StepBatch) -> None:
        for rid, ticket in batch.kv_tickets.items():
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(_Ticket(ticket))
        for out in batch.outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for rid, error in batch.errors.items():
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(EngineError(error.message, error.status, None))

    def _request_done(self, sub: _Subscription, request_id: str) -> None:
        sub.requests.discard(request_id)
        if sub.drain_deadline is not None and not sub.requests and sub.task is not None:
            sub.task.cancel()

    async def _watch_draining(self) -> None:
        """Serve stops a replica (scale-down, redeploy, shutdown) once no call to it is open, and takes it
        out of the router's set first. Subscriptions to a replica outside that set end as soon as none of
        their requests runs there; requests still running after `drain_timeout_s` end with an error."""
        loop = asyncio.get_running_loop()
        while self._subscriptions:
            await asyncio.sleep(DRAIN_POLL_S)
            known = known_replica_ids(self.deployment)
            if known is None:
                continue
            for sub in list(self._subscriptions.values()):
                if sub.replica_id in known:
                    continue
                if sub.drain_deadline is None:
                    sub.drain_deadline = loop.time() + self.drain_timeout_s
                    logger.info("engine replica %s is stopping; %d requests may run %g s more", sub.replica_id,
                                len(sub.requests), self.drain_timeout_s)
                if not sub.requests and sub.task is not None:
                    sub.task.cancel()
                elif loop.time() >= sub.drain_deadline and not sub.cut:
                    sub.cut = True
                    self._cut(sub)

    def _cut(self, sub: _Subscription) -> None:
        message = (f"engine replica {sub.replica_id} is shutting down and this request did not finish within "
                   f"drain_timeout_s={self.drain_timeout_s:g} s; retry it")
        for rid in list(sub.requests):
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(EngineError(message))

    def close(self) -> None:
        """End every subscription now (the ingress is stopping): an engine replica counts an open
        subscription as a request in flight and would otherwise wait out its whole drain timeout."""
        if self._drain_watch is not None:
            self._drain_watch.cancel()
        for sub in list(self._subscriptions.values()):
            if sub.stream is not None:
                sub.stream.cancel()
            if sub.task is not None:
                sub.task.cancel()


class LocalEngineClient(EngineClient):
    """`EngineClient` over an `EngineWorker` in this process (`engine_in_ingress`): the same protocol, with
    the worker's `generate` and `subscribe` generators iterated here instead of through Serve's handle
    calls, so a step's tokens reach the SSE writer without a message between processes. The worker ends
    its own requests when Serve stops this replica (`EngineWorker._watch_drain`)."""

    watch_draining = False

    def __init__(self, worker, replica_wait_timeout_s: float | None = None, drain_timeout_s: float = 30.0) -> None:
        super().__init__(None, replica_wait_timeout_s, drain_timeout_s)
        self.worker = worker

    def _open_generate(self, request: GenerateRequest) -> LocalCall:
        return LocalCall(self.worker.generate(self.subscriber_id, request))

    def _open_subscribe(self, replica_id: str) -> LocalCall:
        return LocalCall(self.worker.subscribe(self.subscriber_id, replica_id))

    def _no_replica_error(self) -> EngineError:
        return EngineError(f"the engine did not accept the request within {self.replica_wait_timeout_s:g} s "
                           "(replica_wait_timeout_s); retry later")


_END = object()


@dataclass(slots=True)
class _Raised:
    error: BaseException


class LocalCall:
    """An async generator of an in-process `EngineWorker`, run in a task of its own and shaped as Serve's
    streaming response: iterate it; `cancel()` cancels the generator where it waits (its `finally` runs,
    as in a replica whose caller went away), and the iteration ends."""

    def __init__(self, agen) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(agen))

    async def _run(self, agen) -> None:
        try:
            async for item in agen:
                self._queue.put_nowait(item)
        except Exception as e:  # cancellation (a BaseException) ends the task without an _END; cancel() queues it
            self._queue.put_nowait(_Raised(e))
        self._queue.put_nowait(_END)

    def __aiter__(self) -> LocalCall:
        return self

    async def __anext__(self):
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, _Raised):
            self._queue.put_nowait(_END)
            raise item.error
        return item

    def cancel(self) -> None:
        if not self._task.done():
            self._task.cancel()
            self._queue.put_nowait(_END)


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"
