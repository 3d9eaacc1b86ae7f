"""The `cuda_ipc` KV transport, for a prefill and a decode replica on ONE GPU (fractional `num_gpus`), where
NCCL before 2.30 refuses two ranks: the decode side maps the prefill side's payload through CUDA IPC and
copies it into its own memory. On CPU the same tickets go through POSIX shared memory (one host).

The sender keeps each payload until `release` or `close`; a ticket is fetched at most once. Who gives the
share up is settled by a claim file per ticket (`ipc_share.take_claim`): the fetching receiver or, for a
ticket nobody fetched, the sender on release. A receiver on another GPU or host refuses a ticket unless
the sender also offered it over a point-to-point `fallback` (the `cuda_ipc+nccl` transport that "auto"
picks on GPUs when the peer is unknown: IPC when the ticket's GPU UUID is the receiver's, else NCCL).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from workers.kv_transfer.base import KVReceiver, KVSender, KVTransferError
from workers.kv_transfer.ipc_share import (Place, SharedHandle, copy_shared, drop_consumer_count, new_claim,
                                           place_of, share, sole_owner, take_claim)
from workers.kv_transfer.layout import KVTransferMeta

# Senders of this process by id: a receiver here copies from them directly (CUDA cannot map its own handles).
_LOCAL_SENDERS: weakref.WeakValueDictionary[str, CudaIpcSender] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class CudaIpcTicket:
    """Header, where the payload lives, the share and its claim file, and the point-to-point ticket when
    the sender also offered the payload over its fallback."""

    meta: KVTransferMeta
    place: Place
    pid: int
    sender_id: str
    claim: str
    handle: SharedHandle
    fallback: Any = None


@dataclass
class _Offer:
    payload: torch.Tensor
    handle: SharedHandle
    claim: str


def _name(fallback: KVSender | KVReceiver | None) -> str:
    return "cuda_ipc" if fallback is None else f"cuda_ipc+{fallback.transport}"


class CudaIpcSender(KVSender):
    """Shares payloads by CUDA IPC (shared memory on CPU) and keeps them until `release`; with a
    `fallback` sender it offers each payload there too, for receivers elsewhere."""

    def __init__(self, fallback: KVSender | None = None) -> None:
        super().__init__()
        self.transport = _name(fallback)
        self.sender_id = uuid.uuid4().hex
        self._fallback = fallback
        self._lock = threading.Lock()
        self._offers: dict[str, _Offer] = {}
        self._seq = itertools.count()
        _LOCAL_SENDERS[self.sender_id] = self

    def offer(self, request_id: str, payload: torch.Tensor, meta: KVTransferMeta) -> CudaIpcTicket:
        self._check_offer(request_id, payload, meta)
        start = time.perf_counter()
        with self._lock:
            if request_id in self._offers:
                raise ValueError(f"request {request_id!r} already has a KV payload on offer")
            kept = sole_owner(payload)
            claim = new_claim(f"{self.sender_id[:12]}-{next(self._seq)}")
            try:
                handle = share(kept)
            except Exception:
                take_claim(claim)
                raise
            offer = self._offers[request_id] = _Offer(kept, handle, claim)
        fallback = None
        if self._fallback is not None:
            try:
                fallback = self._fallback.offer(request_id, kept, replace(meta, transport=self._fallback.transport))
            except Exception:
                self.release(request_id)
                raise
        self._stats.record(meta.nbytes, time.perf_counter() - start)
        return CudaIpcTicket(meta, place_of(kept.device), os.getpid(), self.sender_id, offer.claim, handle, fallback)

    def release(self, request_id: str) -> None:
        with self._lock:
            offer = self._offers.pop(request_id, None)
        if offer is not None and take_claim(offer.claim):
            drop_consumer_count(offer.handle)  # nobody fetched it, nobody will: the count is the sender's to drop
        if self._fallback is not None:
            self._fallback.release(request_id)

    def close(self) -> None:
        """Release every payload on offer and close the fallback."""
        with self._lock:
            request_ids = list(self._offers)
        for request_id in request_ids:
            self.release(request_id)
        if self._fallback is not None:
            self._fallback.close()

    def kept(self, request_id: str) -> torch.Tensor | None:
        """The payload on offer for `request_id`, if any (for a receiver in this process)."""
        with self._lock:
            offer = self._offers.get(request_id)
        return None if offer is None else offer.payload


class CudaIpcReceiver(KVReceiver):
    """Copies payloads shared by CudaIpcSenders on its own GPU (or host, on CPU) into fresh tensors on
    `device` (default: the current CUDA device, else the CPU); other tickets go to the `fallback`."""

    def __init__(self, device: torch.device | None = None, fallback: KVReceiver | None = None) -> None:
        super().__init__()
        self.transport = _name(fallback)
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.place = place_of(device)
        self._fallback = fallback

    def fetch(self, ticket: CudaIpcTicket, out: torch.Tensor | None = None, timeout_s: float = 30) -> torch.Tensor:
        meta = ticket.meta
        self._check_ticket(meta, out)
        start = time.perf_counter()
        try:
            if ticket.place == self.place:
                payload = self._fetch_shared(ticket, out)
            elif self._fallback is not None and ticket.fallback is not None:
                payload = self._fallback.fetch(ticket.fallback, out, timeout_s)
            else:
                raise KVTransferError(
                    f"the KV payload of request {meta.request_id!r} is on {ticket.place.device} of host "
                    f"{ticket.place.host}, this receiver on {self.place.device} of {self.place.host}: cuda_ipc "
                    "hands KV over only within one GPU (one host on CPU); use the nccl or auto KV transport")
        except Exception:
            self._stats.error()
            raise
        self._stats.record(meta.nbytes, time.perf_counter() - start)
        return payload

    def close(self) -> None:
        """Close the fallback; the IPC path keeps no connection."""
        if self._fallback is not None:
            self._fallback.close()

    def _fetch_shared(self, ticket: CudaIpcTicket, out: torch.Tensor | None) -> torch.Tensor:
        meta = ticket.meta
        what = f"KV payload of request {meta.request_id!r} from sender {ticket.sender_id[:8]} (pid {ticket.pid})"
        if not take_claim(ticket.claim):
            raise KVTransferError(f"no {what}: already fetched, released, or the sender closed")
        into = out if out is not None else torch.empty(meta.payload_shape, dtype=meta.layout.torch_dtype,
                                                       device=self.device)
        local = _LOCAL_SENDERS.get(ticket.sender_id) if ticket.pid == os.getpid() else None
        try:
            if local is None:
                copy_shared(ticket.handle, into, self.device, meta.check_payload)
                return into
            try:
                kept = local.kept(meta.request_id)
                if kept is None:
                    raise KVTransferError(f"no {what}: released while being fetched")
                meta.check_payload(kept)
                if kept.is_cuda:  # the sender's stream may still be writing it
                    torch.cuda.synchronize(kept.device)
                into.copy_(kept)
                if into.is_cuda:
                    torch.cuda.current_stream(into.device).synchronize()
            finally:
                drop_consumer_count(ticket.handle)  # the claim is ours and nothing mapped the share
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(f"fetching the {what} failed: {e}") from e
        return into
