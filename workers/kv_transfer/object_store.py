"""The `object_store` KV transport: the payload goes into Ray's object store as a numpy array (bfloat16
viewed as int16), because Ray gets numpy arrays zero-copy. Works across nodes; no thread of its own."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from workers.kv_transfer.base import KVReceiver, KVSender
from workers.kv_transfer.layout import KVTransferMeta


@dataclass(frozen=True)
class ObjectStoreTicket:
    """Header plus the payload's ObjectRef, inside a list so Ray passes the ref on instead of resolving it."""

    meta: KVTransferMeta
    refs: list


def _to_numpy(payload: torch.Tensor) -> Any:
    """A CPU numpy view of the payload; bfloat16 (which numpy lacks) is viewed as int16."""
    payload = payload.detach().cpu().contiguous()
    if payload.dtype == torch.bfloat16:
        payload = payload.view(torch.int16)
    return payload.numpy()


def _from_numpy(array: Any, meta: KVTransferMeta) -> torch.Tensor:
    """Undo `_to_numpy` without copying (the object store's buffer is read-only; torch would warn)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        tensor = torch.from_numpy(array)
    return tensor.view(meta.layout.torch_dtype).view(meta.payload_shape)


class ObjectStoreSender(KVSender):
    """Puts payloads into Ray's object store; keeps the ref until `release`."""

    transport = "object_store"

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[str, Any] = {}

    def offer(self, request_id: str, payload: torch.Tensor, meta: KVTransferMeta) -> ObjectStoreTicket:
        import ray

        self._check_offer(request_id, payload, meta)
        if request_id in self._refs:
            raise ValueError(f"request {request_id!r} already has a KV payload on offer")
        start = time.perf_counter()
        ref = ray.put(_to_numpy(payload))
        self._stats.record(meta.nbytes, time.perf_counter() - start)
        self._refs[request_id] = ref
        return ObjectStoreTicket(meta, [ref])

    def release(self, request_id: str) -> None:
        self._refs.pop(request_id, None)

    def close(self) -> None:
        self._refs.clear()


class ObjectStoreReceiver(KVReceiver):
    """Gets payloads from Ray's object store zero-copy; without `out` the result is a read-only view."""

    transport = "object_store"

    def fetch(self, ticket: ObjectStoreTicket, out: torch.Tensor | None = None,
              timeout_s: float = 30) -> torch.Tensor:
        import ray

        meta = ticket.meta
        self._check_ticket(meta, out)
        start = time.perf_counter()
        try:
            array = ray.get(ticket.refs[0], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            self._stats.error()
            raise TimeoutError(f"KV payload of request {meta.request_id!r} not in the object store "
                               f"within {timeout_s} s") from e
        payload = _from_numpy(array, meta)
        if out is not None:
            payload = out.copy_(payload)
        self._stats.record(meta.nbytes, time.perf_counter() - start)
        return payload

    def close(self) -> None:
        """Nothing to drop: a fetch keeps no connection and no payload."""
