"""The cuda_ipc KV transport's tickets: on CPU (shared memory) within a process and across processes,
release and close, the one-GPU hand-over, another device's tickets refused or fetched point to point."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kv_transfer_helpers import bits, make_cache, offer

from workers.kv_transfer import KVTransferError
from workers.kv_transfer.cuda_ipc import CudaIpcReceiver, CudaIpcSender, CudaIpcTicket
from workers.kv_transfer.ipc_share import Place
from workers.kv_transfer.p2p import P2PReceiver, P2PSender

ROOT = Path(__file__).resolve().parents[2]
FETCH_IN_CHILD = """
import hashlib, pickle, sys
import torch
from workers.kv_transfer.cuda_ipc import CudaIpcReceiver
payload = CudaIpcReceiver(torch.device(sys.argv[1])).fetch(pickle.load(sys.stdin.buffer))
assert payload.device.type == sys.argv[1]
print(hashlib.sha256(payload.cpu().view(torch.uint8).numpy().tobytes()).hexdigest())
"""


def _digest(payload: torch.Tensor) -> str:
    return hashlib.sha256(payload.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def _fetch_in_child(ticket: CudaIpcTicket, device: str) -> str:
    """Fetch the ticket in a fresh Python process on `device`; returns the payload's digest."""
    child = subprocess.run([sys.executable, "-c", FETCH_IN_CHILD, device], input=pickle.dumps(ticket), cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=120)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    return child.stdout.decode().strip()


def _shm_file(ticket: CudaIpcTicket) -> Path:
    return Path("/dev/shm") / ticket.handle.filename.decode().lstrip("/")


def test_cuda_ipc_round_trip_in_one_process():
    cache = make_cache(4, 16, torch.bfloat16, seed=0)
    sender, receiver = CudaIpcSender(), CudaIpcReceiver(torch.device("cpu"))
    payload, ticket = offer(sender, cache, "a")
    assert len(pickle.dumps(ticket)) < 2048
    fetched = receiver.fetch(pickle.loads(pickle.dumps(ticket)))
    assert torch.equal(bits(fetched), bits(payload))

    with pytest.raises(KVTransferError, match="no KV payload of request 'a'.*already fetched"):
        receiver.fetch(ticket)
    payload, ticket = offer(sender, cache, "b")
    out = torch.empty_like(payload)
    assert receiver.fetch(ticket, out=out) is out and torch.equal(bits(out), bits(payload))
    with pytest.raises(ValueError, match="already has a KV payload on offer"):
        offer(sender, cache, "b")
    assert sender.stats()["transfers"] == 2
    assert receiver.stats()["transfers"] == 2 and receiver.stats()["errors"] == 1
    sender.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks for the shared-memory file in /dev/shm")
def test_cuda_ipc_round_trip_across_processes():
    cache = make_cache(4, 16, torch.bfloat16, seed=0)
    sender = CudaIpcSender()
    payload, ticket = offer(sender, cache, "a")
    assert _fetch_in_child(ticket, "cpu") == _digest(payload)
    assert _shm_file(ticket).exists() and not os.path.exists(ticket.claim)  # claimed, but still kept
    sender.release("a")
    assert not _shm_file(ticket).exists()  # the child unmapped it; the sender's release freed it
    sender.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks for the shared-memory file in /dev/shm")
def test_cuda_ipc_release_and_close_free_the_kept_payloads():
    cache = make_cache(4, 16, torch.float32, seed=0)
    sender, receiver = CudaIpcSender(), CudaIpcReceiver(torch.device("cpu"))
    tickets = {rid: offer(sender, cache, rid)[1] for rid in ("a", "b", "c")}
    assert all(_shm_file(t).exists() and os.path.exists(t.claim) for t in tickets.values())

    sender.release("a")
    sender.release("a")  # releasing twice, or an unknown request, is a no-op
    sender.release("nope")
    assert not _shm_file(tickets["a"]).exists() and not os.path.exists(tickets["a"].claim)
    with pytest.raises(KVTransferError, match="no KV payload of request 'a'"):
        receiver.fetch(tickets["a"])
    receiver.fetch(tickets["b"])

    sender.close()
    assert not sender._offers
    for ticket in tickets.values():
        assert not _shm_file(ticket).exists() and not os.path.exists(ticket.claim)
    with pytest.raises(KVTransferError, match="no KV payload of request 'c'"):
        receiver.fetch(tickets["c"])
    payload, ticket = offer(sender, cache, "d")  # a closed sender offers afresh
    assert torch.equal(receiver.fetch(ticket), payload)
    sender.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_ipc_on_one_gpu_hands_over_and_frees_every_share():
    cache = make_cache(4, 16, torch.bfloat16, seed=0).cuda()
    sender, receiver = CudaIpcSender(), CudaIpcReceiver(torch.device("cuda"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    payload, ticket = offer(sender, cache, "a")
    assert _fetch_in_child(ticket, "cuda") == _digest(payload)
    payload_b, unfetched = offer(sender, cache, "b")
    payload_c, local = offer(sender, cache, "c")
    assert torch.equal(bits(receiver.fetch(local)), bits(payload_c))  # same process: no IPC mapping
    del payload, payload_b, payload_c
    sender.release("a")
    sender.release("b")
    sender.release("c")
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == before  # fetched or not, no share stays held
    sender.close()


def test_cuda_ipc_refuses_a_ticket_from_another_device():
    cache = make_cache(4, 16, torch.float32, seed=0)
    sender, receiver = CudaIpcSender(), CudaIpcReceiver(torch.device("cpu"))
    payload, ticket = offer(sender, cache, "a")
    other_gpu = dataclasses.replace(ticket, place=Place(ticket.place.host, "GPU-6f1c0e44-other"))
    other_host = dataclasses.replace(ticket, place=Place("elsewhere/boot", "cpu"))
    for foreign in (other_gpu, other_host):
        with pytest.raises(KVTransferError, match="hands KV over only within one GPU"):
            receiver.fetch(foreign)
    assert torch.equal(receiver.fetch(ticket), payload)  # a refusal does not use the ticket up
    with pytest.raises(ValueError, match="a cuda_ipc ticket cannot be fetched by a gloo receiver"):
        P2PReceiver("gloo").fetch(ticket)
    sender.close()


def test_cuda_ipc_with_a_fallback_fetches_other_devices_tickets_point_to_point():
    cache = make_cache(4, 16, torch.float32, seed=0)
    sender = CudaIpcSender(fallback=P2PSender("gloo", host="127.0.0.1", timeout_s=10))
    receiver = CudaIpcReceiver(torch.device("cpu"), fallback=P2PReceiver("gloo", host="127.0.0.1"))
    assert sender.transport == receiver.transport == "cuda_ipc+gloo"
    payload, ticket = offer(sender, cache, "a")
    assert ticket.fallback.meta.transport == "gloo"
    assert torch.equal(receiver.fetch(ticket, timeout_s=10), payload)  # same place: shared memory

    payload, ticket = offer(sender, cache, "b")
    elsewhere = dataclasses.replace(ticket, place=Place(ticket.place.host, "GPU-6f1c0e44-other"))
    assert torch.equal(receiver.fetch(elsewhere, timeout_s=10), payload)  # another place: gloo
    assert os.path.exists(ticket.claim)  # the IPC share stays until released
    sender.release("b")
    sender.release("a")
    assert not os.path.exists(ticket.claim) and not sender._fallback._payloads and not sender._offers
    receiver.close()
    sender.close()
