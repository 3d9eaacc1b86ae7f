"""The continuous-batching loop: one thread owns the engine and steps it while there is work.

Other threads never touch the engine. They hand requests and aborts to an inbox that the loop drains
between steps, and receive each step's outputs (and engine errors) through one `publish` call per step,
so the cost of crossing threads is paid per step, not per token. A streamed request has an output (its new
tokens) in every step that gives it some; one that is answered whole has a single output, at its end. A
request that the engine refuses or that breaks a step fails alone, with its error published; the loop and
the other requests go on.

The loop builds its engine, from a factory, on its own thread, so that one thread runs every parallel CPU
kernel of the process, from the weight loading and warm-up on. libgomp keeps a pool of
worker threads for each thread that ever opened a parallel region; once the process holds more of them than
it has CPUs, the workers stop spinning between regions and sleep at once, and a decode step, which opens
some 150 short regions, pays a futex wake-up for each. A replica that built its engine on the constructing
thread and stepped it on this one served one stream at 39.1 decode tok/s on a 2-core host, and at 55.5 when
both were this thread (three interleaved runs each, docs/benchmarks.md)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine import Engine, EngineStats, KVImport
from workers.messages import GenerateRequest, RequestError
from workers.output_processor import OutputKind
from workers.outputs import RequestOutput

logger = logging.getLogger(__name__)

Publish = Callable[[list[RequestOutput], dict[str, RequestError], EngineStats, dict[str, torch.Tensor]], None]


@dataclass(slots=True)
class Arrivals:
    """Requests handed to the loop that the last published `EngineStats` do not count yet."""

    num_seqs: int = 0
    num_prompt_tokens: int = 0

    def add(self, request: GenerateRequest) -> None:
        self.num_seqs += request.params.n
        self.num_prompt_tokens += len(request.prompt_token_ids)

    def __add__(self, other: Arrivals) -> Arrivals:
        return Arrivals(self.num_seqs + other.num_seqs, self.num_prompt_tokens + other.num_prompt_tokens)


class EngineLoop:
    def __init__(self, build: Callable[[], Engine], publish: Publish) -> None:
        self._build = build
        self.engine: Engine | None = None  # built by `start`
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._publish = publish
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._adds: list[tuple[GenerateRequest, KVImport | None]] = []
        self._aborts: list[str] = []
        self._releases: list[str] = []
        self._stopped = False
        self.consecutive_failed_steps = 0  # read by the replica's health check
        self.stats: EngineStats | None = None  # the last step's, from `start` on
        self._queued = 0  # requests in the inbox, not yet in the engine
        self._arrived = Arrivals()  # in the inbox
        self._draining = Arrivals()  # taken from the inbox, not yet in `stats`
        self._thread = threading.Thread(target=self._run, name="kvrelay-engine", daemon=True)

    def start(self) -> None:
        """Start the loop; returns once the engine is built (raising what building raised)."""
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled: in the inbox or in the scheduler's queue (read live; a
        deque's length is safe to read from another thread)."""
        return self._queued + self.engine.num_waiting

    def load(self) -> tuple[EngineStats, Arrivals]:
        """The engine's last published stats and the requests added since, read together: every request
        is counted once, in one or the other."""
        with self._lock:
            return self.stats, self._arrived + self._draining

    def add(self, request: GenerateRequest, kv_import: KVImport | None = None) -> None:
        with self._lock:
            self._adds.append((request, kv_import))
            self._queued += 1
            self._arrived.add(request)
        self._wake.set()

    def release_kv(self, request_id: str) -> None:
        """Free the held blocks of a prefill-only request (its transfer is confirmed or its lease ended)."""
        with self._lock:
            self._releases.append(request_id)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def _drain_inbox(self) -> dict[str, RequestError]:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            releases, self._releases = self._releases, []
            self._draining, self._arrived = self._draining + self._arrived, Arrivals()
        errors: dict[str, RequestError] = {}
        for rid in releases:
            self.engine.release_kv(rid)
        for req, kv in adds:
            try:
                kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
                self.engine.add_request(req.request_id, None, req.params, prompt_token_ids=req.prompt_token_ids,
                                        priority=req.priority, output_kind=kind, hold_kv=req.hold_kv, kv_import=kv)
            except ValueError as e:
                errors[req.request_id] = RequestError(str(e))
            except Exception as e:  # a bug, not bad input: this request fails, the loop goes on
                logger.exception("adding request %s failed", req.request_id)
                errors[req.request_id] = RequestError(
                    f"the engine could not take the request: {type(e).__name__}: {e}", 500)
            finally:
                with self._lock:
                    self._queued -= 1
        if aborts:
            self.engine.abort_request(aborts)
        return errors

    def _run(self) -> None:
        try:
            self.engine = self._build()
            self.stats = self.engine.get_stats()
        except BaseException as e:
            self._build_error = e
            return
        finally:
            self._built.set()
        torch.set_num_threads(self.engine.config.num_threads)  # for this thread, which runs every forward pass
        while not self._stopped:
            errors = self._drain_inbox()
            outputs: list[RequestOutput] = []
            stepped = self.engine.has_unfinished_requests()
            if stepped:
                try:
                    outputs = self.engine.step()
                    self.consecutive_failed_steps = 0
                except Exception as e:  # outside the model run (which isolates its failures): fail what is in flight
                    self.consecutive_failed_steps += 1
                    logger.exception("engine step failed")
                    ids = self.engine.unfinished_request_ids()
                    self.engine.abort_request(ids)
                    errors.update({rid: RequestError(f"engine step failed: {e}", 500) for rid in ids})
                finally:  # requests that broke the step, aborted on their own
                    errors.update({rid: RequestError(m, 500) for rid, m in self.engine.failed.items()})
            exports = {o.request_id: self.engine.export_kv(o.request_id) for o in outputs
                       if o.finished and self.engine.holds_kv(o.request_id)}
            self._set_stats(self.engine.get_stats())
            if stepped or errors:  # every step, outputs or not (a final-only request reports at its end)
                self._safe_publish(outputs, errors, exports)
            elif not self.engine.has_unfinished_requests():
                self._safe_publish([], {}, {})
                self._wake.wait(timeout=1.0)
                self._wake.clear()

    def _set_stats(self, stats: EngineStats) -> None:
        with self._lock:
            self.stats = stats
            self._draining = Arrivals()

    def _safe_publish(self, outputs: list[RequestOutput], errors: dict[str, RequestError],
                      exports: dict[str, torch.Tensor]) -> None:
        """Publish one step; a failure there is logged and never ends the loop (its requests still end:
        the subscriber's stream or the lease is the backstop)."""
        try:
            self._publish(outputs, errors, self.stats, exports)
        except Exception:
            logger.exception("publishing an engine step failed")
