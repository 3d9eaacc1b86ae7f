"""Choosing a KV transport by name and building its sender and receiver ends."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.kv_transfer.base import KVReceiver, KVSender
from workers.kv_transfer.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from workers.kv_transfer.object_store import ObjectStoreReceiver, ObjectStoreSender
from workers.kv_transfer.p2p import P2PReceiver, P2PSender

TRANSPORTS = ("object_store", "gloo", "nccl", "cuda_ipc", "cuda_ipc+nccl")


def _unknown(transport: str) -> ValueError:
    return ValueError(f"unknown KV transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")


def resolve_transport(transport: str, device: torch.device, same_gpu: bool | None = None,
                      nccl: bool | None = None) -> str:
    """Pick the concrete transport for engines whose cache is on `device`. "auto": the object store off
    CUDA; on CUDA, cuda_ipc when the other side is known to share the GPU (`same_gpu`), nccl when it is known
    not to, and cuda_ipc+nccl when that is unknown (the receiver picks per ticket); the object store when
    NCCL is missing and the GPU is not known to be shared. `nccl`: whether NCCL is usable (default: whether
    this torch has it)."""
    on_cuda = device.type == "cuda"
    if nccl is None:
        nccl = on_cuda and dist.is_available() and dist.is_nccl_available()
    if transport == "auto":
        if not on_cuda:
            return "object_store"
        if same_gpu:
            return "cuda_ipc"
        if not nccl:
            return "object_store"
        return "nccl" if same_gpu is False else "cuda_ipc+nccl"
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {transport!r}; choose one of auto, {', '.join(TRANSPORTS)}")
    if transport in ("nccl", "cuda_ipc+nccl") and not (on_cuda and nccl):
        raise ValueError(f"the {transport} KV transport needs CUDA tensors and NCCL, got device {device}")
    if transport == "cuda_ipc" and device.type not in ("cuda", "cpu"):
        raise ValueError(f"the cuda_ipc KV transport shares CUDA (or CPU) tensors, got device {device}")
    return transport


def make_sender(transport: str) -> KVSender:
    """The prefill-side end of a concrete transport (resolve "auto" first with `resolve_transport`)."""
    if transport == "object_store":
        return ObjectStoreSender()
    if transport in ("gloo", "nccl"):
        return P2PSender(transport)
    if transport == "cuda_ipc":
        return CudaIpcSender()
    if transport == "cuda_ipc+nccl":
        return CudaIpcSender(fallback=P2PSender("nccl"))
    raise _unknown(transport)


def make_receiver(transport: str, device: torch.device | None = None) -> KVReceiver:
    """The decode-side end of a concrete transport (resolve "auto" first with `resolve_transport`); `device`
    is where cuda_ipc receivers put payloads (default: the current CUDA device, else the CPU)."""
    if transport == "object_store":
        return ObjectStoreReceiver()
    if transport in ("gloo", "nccl"):
        return P2PReceiver(transport)
    if transport == "cuda_ipc":
        return CudaIpcReceiver(device)
    if transport == "cuda_ipc+nccl":
        return CudaIpcReceiver(device, fallback=P2PReceiver("nccl"))
    raise _unknown(transport)
