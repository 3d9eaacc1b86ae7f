"""The two ends every KV transport implements: a `KVSender` on the prefill replica that offers payloads for
tickets, a `KVReceiver` on the decode replica that fetches them, and the errors a fetch raises."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any

import torch

from workers.kv_transfer.layout import KVTransferMeta


class KVTransferError(RuntimeError):
    """A fetch failed: the sender refused it (no such request) or the connection broke."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A fetch ran out of time (sender busy, gone, or never answering)."""


class _Stats:
    """Counters for metrics: completed transfers, their bytes and seconds, and failures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {"transfers": 0, "bytes": 0, "seconds": 0.0, "errors": 0}

    def record(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.counts["transfers"] += 1
            self.counts["bytes"] += nbytes
            self.counts["seconds"] += seconds

    def error(self) -> None:
        with self._lock:
            self.counts["errors"] += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counts)


class KVSender(ABC):
    """Prefill side: holds packed payloads until the decode side fetches them."""

    transport: str

    def __init__(self) -> None:
        self._stats = _Stats()

    @abstractmethod
    def offer(self, request_id: str, payload: torch.Tensor, meta: KVTransferMeta) -> Any:
        """Make `payload` fetchable; returns a small picklable ticket for the decode side."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Drop anything still kept for `request_id` (after the decode side has it, or gave up)."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving, stop every thread this sender started and free everything kept; a later `offer`
        starts afresh."""

    def stats(self) -> dict[str, float]:
        return self._stats.snapshot()

    def _check_offer(self, request_id: str, payload: torch.Tensor, meta: KVTransferMeta) -> None:
        if meta.request_id != request_id or meta.transport != self.transport:
            raise ValueError(f"offer for {request_id!r} over {self.transport} got a header for "
                             f"{meta.request_id!r} over {meta.transport}")
        meta.check_payload(payload)


class KVReceiver(ABC):
    """Decode side: turns a ticket from the prefill side into the payload tensor."""

    transport: str

    def __init__(self) -> None:
        self._stats = _Stats()

    @abstractmethod
    def fetch(self, ticket: Any, out: torch.Tensor | None = None, timeout_s: float = 30) -> torch.Tensor:
        """The ticket's payload, written into `out` when given (same shape and dtype)."""

    @abstractmethod
    def close(self) -> None:
        """Disconnect from every sender and stop every thread this receiver started; a later `fetch`
        connects afresh."""

    def stats(self) -> dict[str, float]:
        return self._stats.snapshot()

    def _check_ticket(self, meta: KVTransferMeta, out: torch.Tensor | None) -> None:
        if meta.transport != self.transport:
            raise ValueError(f"a {meta.transport} ticket cannot be fetched by a {self.transport} receiver")
        if out is not None:
            meta.check_payload(out)
