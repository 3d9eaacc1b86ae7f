"""Choosing a KV transport by name and building its sender and receiver ends."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.kv_transfer.base import KVReceiver, KVSender
from workers.kv_transfer.object_store import ObjectStoreReceiver, ObjectStoreSender
from workers.kv_transfer.p2p import P2PReceiver, P2PSender

TRANSPORTS = ("object_store", "gloo", "nccl")


def _unknown(transport: str) -> ValueError:
    return ValueError(f"unknown KV transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")


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


def make_sender(transport: str) -> KVSender:
    """The prefill-side end of a concrete transport (resolve "auto" first with `resolve_transport`)."""
    if transport == "object_store":
        return ObjectStoreSender()
    if transport in ("gloo", "nccl"):
        return P2PSender(transport)
    raise _unknown(transport)


def make_receiver(transport: str) -> KVReceiver:
    """The decode-side end of a concrete transport (resolve "auto" first with `resolve_transport`)."""
    if transport == "object_store":
        return ObjectStoreReceiver()
    if transport in ("gloo", "nccl"):
        return P2PReceiver(transport)
    raise _unknown(transport)
