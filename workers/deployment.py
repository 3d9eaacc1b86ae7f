"""The engine replica: a Ray Serve deployment that owns one engine and runs its loop in a thread.

Streaming protocol (see docs/architecture.md for the measured reasons):
- `generate(subscriber_id, request)` is an async generator per request. It yields one `Accepted` (or one
  `Rejected`) and then stays open until the request finishes; cancelling it aborts the request, so a
  client that goes away frees its KV blocks, and Serve counts it as one ongoing request (autoscaling).
- `subscribe(subscriber_id)` is one long-lived stream per ingress replica. Every engine step yields at
  most one `StepBatch` with the new tokens of all that ingress's requests, so the cost of a Serve message
  is paid per step, not per token per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import partial

import torch
from ray import serve

from workers.admission import RETRY_AFTER_S, AdmissionPolicy, ReplicaLoad, ShedReason
from workers.config import EngineConfig
from workers.engine import Engine, EngineStats, KVImport
from workers.engine_loop import EngineLoop
from workers.kv_transfer import KVLayout, KVTransferMeta, make_receiver, make_sender, resolve_transport
from workers.messages import Accepted, GenerateRequest, ModelInfo, Rejected, RequestError, StepBatch
from workers.metrics import EngineMetrics
from workers.outputs import RequestOutput
from workers.replica_drain import DRAIN_POLL_S, ReplicaStopping, serve_stop_flag

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Subscriber:
    pending: StepBatch = field(default_factory=StepBatch)
    event: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True, eq=False)
class _InFlight:
    subscriber_id: str
    done: asyncio.Future


@dataclass(slots=True)
class StartupTimes:
    """Wall-clock readings (`time.time()`) of a replica's start, to say where a restart's time goes."""

    process_started: float
    constructor_started: float
    engine_ready: float = 0.0


class EngineLoopStopped(RuntimeError):
    """The replica's engine loop thread has ended; its requests cannot finish here."""


class EngineWorker:
    """`role`: "colocated" (prefill and decode), "prefill" (computes the prompt and the first token, then
    holds the prompt's KV for a decode replica to fetch, until confirmed or `kv_lease_s` passes) or
    "decode" (fetches the prompt's KV by ticket and continues).

    `max_failed_steps`: after this many engine steps in a row fail, `check_health` reports the replica
    unhealthy, so Serve replaces it.

    `drain_timeout_s`: once Serve starts stopping the replica, requests still running this long after end
    with `ReplicaStopping` (the ingress answers 503); then its subscriber streams end, so Serve's drain
    completes without waiting for its force-kill."""

    def __init__(self, engine_config: EngineConfig | dict | None = None, max_waiting_requests: int | None = None,
                 role: str = "colocated", kv_transport: str = "auto", kv_lease_s: float = 30.0,
                 kv_fetch_delay_s: float = 0.0, max_failed_steps: int = 5, drain_timeout_s: float = 30.0) -> None:
        self._startup = StartupTimes(_process_start_time(), time.time())
        if role not in ("colocated", "prefill", "decode"):
            raise ValueError(f"role must be colocated, prefill or decode, got {role!r}")
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.max_failed_steps, self.drain_timeout_s = max_failed_steps, drain_timeout_s
        if isinstance(engine_config, dict) or engine_config is None:
            engine_config = EngineConfig(**(engine_config or {}))
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit tests)
            self.replica_id = "local"
        self.admission = AdmissionPolicy(max_waiting_requests, engine_config.max_num_seqs)
        self.metrics = EngineMetrics(self.replica_id)
        self._subscribers: dict[str, _Subscriber] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self._aio: asyncio.AbstractEventLoop | None = None
        self.role, self.kv_lease_s, self.kv_fetch_delay_s = role, kv_lease_s, kv_fetch_delay_s
        self._sender = self._receiver = None
        # the engine is built on the loop's thread, the one that runs its every step (see workers/engine_loop.py)
        self.loop = EngineLoop(partial(Engine, engine_config), self._on_step)
        self.loop.start()
        self.engine = self.loop.engine
        self.layout = KVLayout.of(self.engine.runner.kv_cache, self.engine.model_path)
        device = self.engine.runner.kv_cache.device
        self.transport = resolve_transport(kv_transport, device)
        self._sender = make_sender(self.transport) if role == "prefill" else None
        self._receiver = make_receiver(self.transport, device) if role == "decode" else None
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._waiting_for_kv = 0
        self._stop_flag = serve_stop_flag()
        self._drain_watch: asyncio.Task | None = None
        self._drained = False  # stopping, and nothing runs here any more
        self._startup.engine_ready = time.time()

    # ---- called by the ingress -----------------------------------------------------------------

    async def generate(self, subscriber_id: str, request: GenerateRequest):
        self._attach()
        rid = request.request_id
        if rid in self._in_flight:
            yield Rejected(400, f"request id {rid!r} is already in use")
            return
        if self._drained:
            yield Rejected(503, f"replica {self.replica_id} is shutting down; retry", "service_unavailable",
                           RETRY_AFTER_S)
            return
        if request.hold_kv and self.role != "prefill":
            yield Rejected(400, f"replica {self.replica_id} is a {self.role} replica; only a prefill replica "
                                "holds KV for a hand-off (hold_kv)")
            return
        lost = self.engine.runner.unavailable
        if lost is not None:
            yield Rejected(503, f"replica {self.replica_id} cannot run its model ({lost}); it is being replaced, "
                                "retry", "service_unavailable", RETRY_AFTER_S)
            return
        shed = self._admit(request)
        if shed is not None:
            yield shed
            return
        kv: KVImport | None = None
        if request.kv_ticket is not None:
            kv = await self._fetch_kv(request)
            if isinstance(kv, Rejected):
                yield kv
                return
        done = self._aio.create_future()
        self._in_flight[rid] = _InFlight(subscriber_id, done)
        self._subscribers.setdefault(subscriber_id, _Subscriber())
        self.loop.add(request, kv)
        try:
            yield Accepted(self.replica_id)
            await done
        finally:
            if self._in_flight.pop(rid, None) is not None:  # still running: the caller went away
                self.loop.abort(rid)

    def _admit(self, request: GenerateRequest) -> Rejected | None:
        """None to queue the request, else its refusal (the rule is in `workers/admission.py`)."""
        load = self.load()
        reason = self.admission.check(load, request.params.n, len(request.prompt_token_ids))
        if reason is None:
            return None
        self.metrics.observe_rejected(reason)
        why = (f"{load.num_running} sequences running (max_num_seqs={self.admission.max_num_seqs}) and "
               f"{load.num_waiting} waiting (max_waiting_requests={self.admission.max_waiting_requests})")
        if reason is ShedReason.KV_CACHE_FULL:
            why += (f", and KV cache room for {load.num_free_kv_tokens:,} tokens, short of the "
                    f"{load.num_pending_tokens:,} backlog tokens plus this prompt")
        return Rejected(429, f"the server is busy: replica {self.replica_id} has {why}; retry after "
                             f"{RETRY_AFTER_S} s", "server_overloaded", RETRY_AFTER_S)

    def load(self) -> ReplicaLoad:
        """This replica's load as admission reads it: the engine's last step plus what arrived since."""
        stats, arrived = self.loop.load()
        block_size, num_blocks = self.engine.config.block_size, self.engine.num_kv_blocks
        free_blocks = round((1.0 - stats.kv_cache_usage) * num_blocks)
        return ReplicaLoad(num_running=stats.num_running,
                           num_waiting=stats.num_waiting + arrived.num_seqs + self._waiting_for_kv,
                           num_pending_tokens=stats.num_pending_tokens + arrived.num_prompt_tokens,
                           num_free_kv_tokens=free_blocks * block_size, kv_capacity_tokens=num_blocks * block_size)

    async def _fetch_kv(self, request: GenerateRequest) -> KVImport | Rejected:
        """Decode pool: pull the prompt's KV named by the request's ticket (off the event loop)."""
        if self._receiver is None:
            return Rejected(400, f"replica {self.replica_id} is not in a decode pool; it cannot take KV hand-offs")
        meta = request.kv_ticket.meta
        try:
            meta.layout.check_compatible(self.layout)
        except ValueError as e:
            return Rejected(400, str(e))
        self._waiting_for_kv += 1
        self.metrics.waiting_for_kv.set(self._waiting_for_kv)
        try:
            if self.kv_fetch_delay_s:
                await asyncio.sleep(self.kv_fetch_delay_s)
            start = time.monotonic()
            payload = await asyncio.to_thread(self._receiver.fetch, request.kv_ticket)
        except Exception as e:
            return Rejected(503, f"fetching the prompt's KV ({self.transport}) failed: {e}", "service_unavailable")
        finally:
            self._waiting_for_kv -= 1
            self.metrics.waiting_for_kv.set(self._waiting_for_kv)
        self.metrics.observe_kv_transfer("receive", self.transport, meta.nbytes, time.monotonic() - start)
        return KVImport(meta.num_tokens, payload)

    def release_kv(self, request_id: str, replica_id: str | None = None) -> None:
        """Prefill pool: the decode side has the KV of `request_id`; free its blocks now."""
        self._end_lease(request_id)

    def _end_lease(self, request_id: str, expired: bool = False) -> None:
        timer = self._leases.pop(request_id, None)
        if timer is None:
            return
        timer.cancel()
        if expired:
            self.metrics.kv_lease_expired.inc()
        self._sender.release(request_id)
        self.loop.release_kv(request_id)

    async def subscribe(self, subscriber_id: str, replica_id: str | None = None):
        """Per-step output batches for one ingress replica. `replica_id` pins the call to this replica
        (read by `router.request_router.KVRelayRequestRouter`)."""
        self._attach()
        sub = self._subscribers.setdefault(subscriber_id, _Subscriber())
        try:
            yield self.replica_id
            while True:
                batch, sub.pending = sub.pending, StepBatch()
                if batch.outputs or batch.errors:
                    yield batch
                if self._drained:  # what was pending when the replica drained has gone out above
                    break
                await sub.event.wait()
                sub.event.clear()
        finally:
            if self._subscribers.get(subscriber_id) is sub:
                del self._subscribers[subscriber_id]

    def model_info(self) -> ModelInfo:
        e = self.engine
        return ModelInfo(e.model_path, e.max_model_len, e.vocab_size, e.config.block_size, str(e.dtype))

    def metrics_text(self, replica_id: str | None = None) -> tuple[str, bytes]:
        """This replica's Prometheus exposition (`replica_id` pins the call, as for `subscribe`)."""
        return self.replica_id, self.metrics.render()

    def record_routing_stats(self) -> dict:
        """Pulled by Serve every `request_routing_stats_period_s`; read by the request router."""
        s = self.loop.stats
        return {"pending_tokens": s.num_pending_tokens, "kv_cache_usage": s.kv_cache_usage,
                "num_waiting": self.loop.num_waiting, "num_running": s.num_running}

    async def check_health(self) -> None:
        """Serve calls this every `health_check_period_s`; three failures in a row and it replaces the
        replica. A stopped engine loop also fails the requests still waiting on it, at once."""
        if not self.loop.is_alive():
            message = f"the engine loop of replica {self.replica_id} has stopped"
            self._fail_in_flight(EngineLoopStopped(message))
            raise EngineLoopStopped(message)
        await self.engine.runner.check_alive()  # tensor-parallel ranks: a lost one fails the replica
        failed = self.loop.consecutive_failed_steps
        if failed >= self.max_failed_steps:
            raise RuntimeError(f"the last {failed} engine steps of replica {self.replica_id} failed "
                               f"(max_failed_steps={self.max_failed_steps}); see its log for the errors")

    def _fail_in_flight(self, error: Exception) -> None:
        """End every open `generate` call with an error (the ingress answers 503)."""
        entries, self._in_flight = list(self._in_flight.values()), {}
        for entry in entries:
            if not entry.done.done():
                entry.done.set_exception(error)

    def _attach(self) -> None:
        """Runs in each call from the ingress: the replica's event loop is known from the first one on."""
        self._aio = asyncio.get_running_loop()
        if self._stop_flag is not None and self._drain_watch is None:
            self._drain_watch = self._aio.create_task(self._watch_drain())

    async def _watch_drain(self) -> None:
        """From the moment Serve starts stopping this replica, its requests have `drain_timeout_s` to
        finish; the rest are aborted (their KV blocks freed) and end with `ReplicaStopping`."""
        while not self._stop_flag():
            await asyncio.sleep(DRAIN_POLL_S)
        deadline = self._aio.time() + self.drain_timeout_s
        logger.info("replica %s is stopping; %d requests may run %g s more", self.replica_id, len(self._in_flight),
                    self.drain_timeout_s)
        while self._in_flight and self._aio.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self._in_flight:
            logger.info("replica %s ends %d requests still running after drain_timeout_s", self.replica_id,
                        len(self._in_flight))
            message = (f"engine replica {self.replica_id} is shutting down and this request did not finish "
                       f"within drain_timeout_s={self.drain_timeout_s:g} s; retry it")
            for rid, entry in self._in_flight.items():
                self.loop.abort(rid)
                # the reason also goes out on the subscriber stream, ahead of its end: the ingress may see
                # that stream close before the generate call's error arrives
                sub = self._subscribers.get(entry.subscriber_id)
                if sub is not None:
                    sub.pending.errors[rid] = RequestError(message, 503)
            self._fail_in_flight(ReplicaStopping(message))
        self._drained = True
        for sub in self._subscribers.values():
            sub.event.set()

    def startup_times(self) -> dict[str, float]:
        """When this replica's process started, its constructor began, and its engine was ready."""
        return {"process_started": self._startup.process_started,
                "constructor_started": self._startup.constructor_started,
                "engine_ready": self._startup.engine_ready}

    def shutdown(self) -> None:
        """Stop the engine loop and its tensor-parallel ranks, then close the KV sender or receiver (their
        threads, stores and groups).
        Serve calls `__del__` when it shuts the replica down; attributes may be missing if `__init__` failed."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        for end in (getattr(self, "_sender", None), getattr(self, "_receiver", None)):
            if end is not None:
                end.close()

    def __del__(self) -> None:
        self.shutdown()

    # ---- engine thread -> event loop -----------------------------------------------------------

    def _on_step(self, outputs: list[RequestOutput], errors: dict[str, RequestError], stats: EngineStats,
                 exports: dict[str, torch.Tensor]) -> None:
        """Runs on the engine thread once per step: metrics and KV offers here, delivery on the replica's
        event loop."""
        self.metrics.observe_step(stats, outputs)
        tickets = {}
        for rid, payload in exports.items():
            start = time.monotonic()
            meta = KVTransferMeta(rid, payload.shape[2], self.layout, self.transport,
                                  payload.numel() * payload.element_size())
            tickets[rid] = self._sender.offer(rid, payload, meta)
            self.metrics.observe_kv_transfer("send", self.transport, meta.nbytes, time.monotonic() - start)
        if (outputs or errors) and self._aio is not None:
            self._aio.call_soon_threadsafe(self._dispatch, outputs, errors, tickets)

    def _dispatch(self, outputs: list[RequestOutput], errors: dict[str, RequestError], tickets: dict) -> None:
        touched: set[int] = set()
        subs: list[_Subscriber] = []

        def deliver(rid: str) -> StepBatch | None:
            entry = self._in_flight.get(rid)
            sub = self._subscribers.get(entry.subscriber_id) if entry is not None else None
            if sub is None:
                return None
            if id(sub) not in touched:
                touched.add(id(sub))
                subs.append(sub)
            return sub.pending

        for rid, ticket in tickets.items():
            self._leases[rid] = self._aio.call_later(self.kv_lease_s, self._end_lease, rid, True)
            batch = deliver(rid)
            if batch is not None:
                batch.kv_tickets[rid] = ticket
        for out in outputs:
            batch = deliver(out.request_id)
            if batch is not None:
                out.prompt, out.prompt_token_ids = None, []  # the ingress has them; do not resend every step
                batch.outputs.append(out)
            if out.finished:
                self._resolve(out.request_id)
        for rid, error in errors.items():
            batch = deliver(rid)
            if batch is not None:
                batch.errors[rid] = error
            self._resolve(rid)
        for sub in subs:
            sub.event.set()

    def _resolve(self, request_id: str) -> None:
        entry = self._in_flight.pop(request_id, None)
        if entry is not None and not entry.done.done():
            entry.done.set_result(None)


def _process_start_time() -> float:
    import psutil

    return psutil.Process().create_time()


def worker_deployment(name: str = "EngineWorker"):
    """The Serve deployment of `EngineWorker` with our defaults (no CPU reservation: the engine sets its
    own thread count; many ongoing requests per replica: each is one sequence, not one forward pass).
    The health-check and drain timings come from `AppConfig.worker_deployment_options`."""
    return serve.deployment(EngineWorker, name=name, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
