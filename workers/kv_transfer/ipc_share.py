"""Sharing one tensor with other processes on the same host without copying it through a socket: a CUDA
tensor by its CUDA IPC handle, a CPU tensor by the name of the POSIX shared-memory file holding it. Also
where a tensor lives (`Place`) and the claim files that let exactly one side give up a share.

CUDA: `reduce_tensor` (what `torch.multiprocessing` pickles) yields the IPC memory and event handles and a
reference counter in shared memory set to 1: the producer keeps the memory out of reuse until that count
drops to 0, which a consumer does when its mapped storage is freed. A share nobody maps must have its
count dropped by hand (`drop_consumer_count`), or the memory stays held until the process exits.

CPU: the storage moves into a shared-memory file (`_share_filename_cpu_`, what the "file_system" sharing
strategy does) without touching the process-wide strategy. The file counts the mappings of every process
and is unlinked when the last one closes, so the sender's copy keeps it alive and nothing else is owed.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

CUDA_ARGS = ("tensor_cls", "shape", "stride", "storage_offset", "storage_cls", "dtype", "device", "handle",
             "storage_nbytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
             "ref_counter_offset", "event_handle", "event_sync_required")


@dataclass(frozen=True)
class Place:
    """Where a tensor lives, as far as sharing goes: processes with the same `host` share /dev/shm, and
    those on the same GPU (`device`: its UUID, or "cpu") can map each other's CUDA memory."""

    host: str
    device: str


@dataclass(frozen=True)
class ShmHandle:
    """A CPU tensor in a shared-memory file, opened by name."""

    manager: bytes
    filename: bytes
    storage_nbytes: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class CudaHandle:
    """A CUDA tensor's IPC handles and layout: the fields of `reduce_tensor`'s `rebuild_cuda_tensor` call."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: str
    handle: bytes
    storage_nbytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


SharedHandle = ShmHandle | CudaHandle


@cache
def host_id() -> str:
    """This machine (host name and boot id): processes with equal ids can open each other's shared memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def place_of(device: torch.device) -> Place:
    """The place of tensors on `device` (a CUDA device without an index means the current one)."""
    if device.type == "cpu":
        return Place(host_id(), "cpu")
    if device.type != "cuda":
        raise ValueError(f"cuda_ipc shares CPU and CUDA tensors, not {device.type} ones")
    return Place(host_id(), _gpu_uuid(device.index if device.index is not None else torch.cuda.current_device()))


@cache
def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def sole_owner(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy when it shares its storage with other data (a share exposes the whole storage)."""
    tensor = tensor.detach()
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and \
            tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def share(tensor: torch.Tensor) -> SharedHandle:
    """Share a tensor that alone owns its storage (see `sole_owner`); it must outlive every open of the
    handle. A CPU tensor moves into shared memory; a CUDA one records an event after the work queued so far
    on the current stream, which an opener waits on."""
    if tensor.is_cuda:
        rebuild, args = reduce_tensor(tensor)
        if rebuild is not rebuild_cuda_tensor or len(args) != len(CUDA_ARGS):
            raise RuntimeError(f"torch {torch.__version__} reduces CUDA tensors differently from what the "
                               f"cuda_ipc KV transport knows ({len(CUDA_ARGS)} arguments to rebuild_cuda_tensor)")
        a = dict(zip(CUDA_ARGS, args))
        return CudaHandle(tuple(a["shape"]), tuple(a["stride"]), a["storage_offset"], str(a["dtype"]),
                          a["handle"], a["storage_nbytes"], a["storage_offset_bytes"], a["ref_counter_handle"],
                          a["ref_counter_offset"], a["event_handle"], a["event_sync_required"])
    if tensor.device.type != "cpu":
        raise ValueError(f"cuda_ipc shares CPU and CUDA tensors, not {tensor.device.type} ones")
    manager, filename, nbytes = tensor.untyped_storage()._share_filename_cpu_()
    return ShmHandle(manager, filename, nbytes, tensor.storage_offset(), tuple(tensor.shape),
                     tuple(tensor.stride()), str(tensor.dtype))


def drop_consumer_count(handle: SharedHandle) -> None:
    """Give back the count a consumer would drop when done with a CUDA share, for a share nobody will map
    (or one mapped without `copy_shared`); no-op for CPU shares."""
    if isinstance(handle, CudaHandle):
        torch.UntypedStorage._release_ipc_counter(handle.ref_counter_handle, handle.ref_counter_offset)


def copy_shared(handle: SharedHandle, into: torch.Tensor, device: torch.device,
                check: Callable[[torch.Tensor], None]) -> None:
    """Map a share made by another process on this host, `check` it, copy it into `into` and unmap it.
    `device` is this process's index of the share's GPU. Drops a CUDA share's consumer count exactly once,
    even when mapping fails."""
    if isinstance(handle, ShmHandle):
        storage = torch.UntypedStorage._new_shared_filename_cpu(handle.manager, handle.filename,
                                                                handle.storage_nbytes)
        source = torch.empty(0, dtype=_dtype(handle.dtype)).set_(storage, handle.storage_offset, handle.shape,
                                                                  handle.stride)
        check(source)
        into.copy_(source)
        return
    try:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, handle.handle, handle.storage_nbytes, handle.storage_offset_bytes,
            handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle, handle.event_sync_required)
    except Exception:
        drop_consumer_count(handle)
        raise
    # From here on the mapped storage owns the count: freeing it (on return) syncs the stream and drops it.
    source = torch.empty(0, dtype=_dtype(handle.dtype), device=device).set_(
        storage, handle.storage_offset, handle.shape, handle.stride)
    check(source)
    into.copy_(source)
    torch.cuda.current_stream(device).synchronize()


@cache
def _claim_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def new_claim(name: str) -> str:
    """Create an empty claim file for one share and return its path; see `take_claim`."""
    path = os.path.join(_claim_dir(), f"kvrelay-claim-{os.getpid()}-{name}")
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


def take_claim(path: str) -> bool:
    """Unlink the claim file: True for the one caller (in any process) that removed it, False for the rest.
    The receiver takes it to fetch; the sender takes it on release, and then owes the consumer count."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))
