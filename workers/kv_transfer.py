"""Moving one request's KV cache from a prefill engine replica to a decode engine replica.

Wire format: a `KVTransferMeta` header plus one contiguous payload tensor of shape
`[num_layers, 2, num_tokens, num_kv_heads, head_dim]` (dim 1: 0 = K, 1 = V) in the cache dtype, holding
only the request's used tokens in token order. The payload does not depend on either side's block table.

Transports: `object_store` puts the payload into Ray's object store (as a numpy array, bfloat16 viewed as
int16, because Ray gets numpy arrays zero-copy). `gloo` (and `nccl` for CUDA tensors) sends it point to
point over a two-rank process group made per (sender, receiver) pair, without `init_process_group`.

The point-to-point transports and their protocol are in `workers/kv_transfer_p2p.py`.
"""

from __future__ import annotations

import threading
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist


TRANSPORTS = ("object_store", "gloo", "nccl")


@dataclass(frozen=True)
class KVLayout:
    """What a KV payload's shape and bytes mean; both pools must agree before blocks move between them."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @classmethod
    def of(cls, kv_cache: torch.Tensor, model: str) -> KVLayout:
        """The layout of an engine's `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` cache."""
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(model, num_layers, num_kv_heads, head_dim, block_size, str(kv_cache.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ValueError naming every field (with both values) where the two pools differ."""
        diffs = [f"{f.name} {getattr(self, f.name)} vs {getattr(other, f.name)}"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise ValueError(f"prefill and decode pools differ: {', '.join(diffs)}")


@dataclass(frozen=True)
class KVTransferMeta:
    """Header of one transfer: which request, how many tokens, and the layout and size of its payload."""

    request_id: str
    num_tokens: int
    layout: KVLayout
    transport: str
    nbytes: int

    @property
    def payload_shape(self) -> tuple[int, ...]:
        a = self.layout
        return (a.num_layers, 2, self.num_tokens, a.num_kv_heads, a.head_dim)

    def check_payload(self, payload: torch.Tensor) -> None:
        """Raise ValueError unless `payload` has this header's shape, dtype and size."""
        problems = []
        if tuple(payload.shape) != self.payload_shape:
            problems.append(f"shape {tuple(payload.shape)} vs {self.payload_shape}")
        if str(payload.dtype) != self.layout.dtype:
            problems.append(f"dtype {payload.dtype} vs {self.layout.dtype}")
        if payload.nbytes != self.nbytes:
            problems.append(f"nbytes {payload.nbytes} vs {self.nbytes}")
        if problems:
            raise ValueError(f"KV payload for request {self.request_id!r} does not match its header: "
                             f"{', '.join(problems)}")


def _token_slots(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Flat slot (block * block_size + offset) of each of the first `num_tokens` tokens."""
    num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
    needed = -(-num_tokens // block_size)
    if num_tokens < 0 or len(block_ids) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {block_size}, got {len(block_ids)}")
    blocks = torch.tensor(block_ids[:needed], dtype=torch.long)
    if needed and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(f"block ids {block_ids[:needed]} out of range for a pool of {num_blocks} blocks")
    t = torch.arange(num_tokens)
    return (blocks[t // block_size] * block_size + t % block_size).to(kv_cache.device)


def _flat_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as `[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]`, sharing storage."""
    if kv_cache.dim() != 6 or not kv_cache.is_contiguous():
        raise ValueError(f"expected a contiguous 6-d KV cache, got shape {tuple(kv_cache.shape)}")
    num_layers, two, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    return kv_cache.view(num_layers, two, num_blocks * block_size, num_kv_heads, head_dim)


def pack_kv(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Gather a request's first `num_tokens` tokens into one contiguous payload (see module docstring)."""
    return _flat_view(kv_cache).index_select(2, _token_slots(kv_cache, block_ids, num_tokens))


def unpack_kv(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int, payload: torch.Tensor) -> None:
    """Scatter a payload into this cache's blocks `block_ids`; other blocks are left untouched."""
    num_layers, _, _, _, num_kv_heads, head_dim = kv_cache.shape
    expected = (num_layers, 2, num_tokens, num_kv_heads, head_dim)
    if tuple(payload.shape) != expected or payload.dtype != kv_cache.dtype:
        raise ValueError(f"KV payload {tuple(payload.shape)} {payload.dtype} does not fit this cache: "
                         f"expected {expected} {kv_cache.dtype}")
    slots = _token_slots(kv_cache, block_ids, num_tokens)
    _flat_view(kv_cache).index_copy_(2, slots, payload.to(kv_cache.device))


def resolve_transport(transport: str, device: torch.device) -> str:
    """Pick the concrete transport: "auto" means NCCL for CUDA engines when available, else the object store."""
    nccl_ok = device.type == "cuda" and dist.is_available() and dist.is_nccl_available()
    if transport == "auto":
        return "nccl" if nccl_ok else "object_store"
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {transport!r}; choose one of auto, {', '.join(TRANSPORTS)}")
    if transport == "nccl" and not nccl_ok:
        raise ValueError(f"the nccl KV transport needs CUDA tensors and NCCL, got device {device}")
    return transport


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

    def close(self) -> None:
        """Stop serving and free everything kept."""

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

    def close(self) -> None:
        """Disconnect from every sender."""

    def stats(self) -> dict[str, float]:
        return self._stats.snapshot()

    def _check_ticket(self, meta: KVTransferMeta, out: torch.Tensor | None) -> None:
        if meta.transport != self.transport:
            raise ValueError(f"a {meta.transport} ticket cannot be fetched by a {self.transport} receiver")
        if out is not None:
            meta.check_payload(out)


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


def _from_numpy(array: Any, meta: KVTransferMeta) -> torch.Tensor:
    """Undo `_to_numpy` without copying (the object store's buffer is read-only; torch would warn)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        tensor = torch.from_numpy(array)
    return tensor.view(meta.layout.torch_dtype).view(meta.payload_shape)


class KVTransferError(RuntimeError):
    """A fetch failed: the sender refused it (no such request) or the connection broke."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A fetch ran out of time (sender busy, gone, or never answering)."""


def make_sender(transport: str) -> KVSender:
    """The prefill-side end of a concrete transport (resolve "auto" first with `resolve_transport`)."""
    if transport == "object_store":
        return ObjectStoreSender()
    if transport in ("gloo", "nccl"):
        from workers.kv_transfer_p2p import P2PSender

        return P2PSender(transport)
    raise ValueError(f"unknown KV transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")


def make_receiver(transport: str) -> KVReceiver:
    """The decode-side end of a concrete transport (resolve "auto" first with `resolve_transport`)."""
    if transport == "object_store":
        return ObjectStoreReceiver()
    if transport in ("gloo", "nccl"):
        from workers.kv_transfer_p2p import P2PReceiver

        return P2PReceiver(transport)
    raise ValueError(f"unknown KV transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
