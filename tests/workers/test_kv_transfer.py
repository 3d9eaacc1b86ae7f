"""KV transfer between engine replicas: pack/unpack across different block tables, layout checks, and the
object-store and gloo transports between two Ray actors. The cuda_ipc transport's tests are in
test_kv_transfer_cuda_ipc.py."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest
import kv_transfer_helpers
import torch
from kv_transfer_helpers import HEAD_DIM, HEADS, LAYERS, bits, make_cache, offer

from workers.kv_transfer import (KVLayout, KVTransferError, KVTransferMeta, make_receiver, make_sender, pack_kv,
                                 resolve_transport, unpack_kv)
from workers.kv_transfer.p2p import P2PReceiver, P2PSender


def _reference_pack(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Per-token loop, the obvious definition of the payload."""
    block_size = kv_cache.shape[3]
    tokens = [kv_cache[:, :, block_ids[t // block_size], t % block_size] for t in range(num_tokens)]
    return torch.stack(tokens, dim=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16])
def test_pack_unpack_round_trip_across_block_tables(block_size, dtype):
    num_tokens = 37  # not a multiple of 16
    needed = -(-num_tokens // block_size)
    src = make_cache(needed + 5, block_size, dtype, seed=0)
    dst = make_cache(needed + 9, block_size, dtype, seed=1)
    src_ids = torch.randperm(needed + 5, generator=torch.Generator().manual_seed(2))[:needed].tolist()
    dst_ids = torch.randperm(needed + 9, generator=torch.Generator().manual_seed(3))[:needed].tolist()
    before = dst.clone()

    payload = pack_kv(src, src_ids, num_tokens)
    assert payload.shape == (LAYERS, 2, num_tokens, HEADS, HEAD_DIM) and payload.is_contiguous()
    assert torch.equal(bits(payload), bits(_reference_pack(src, src_ids, num_tokens)))
    unpack_kv(dst, dst_ids, num_tokens, payload)

    assert torch.equal(bits(pack_kv(dst, dst_ids, num_tokens)), bits(payload))
    unused = [b for b in range(dst.shape[2]) if b not in dst_ids]
    assert torch.equal(bits(dst[:, :, unused]), bits(before[:, :, unused]))
    tail = num_tokens % block_size
    if tail:  # the last block's slots past the request's tokens stay as they were
        last = dst_ids[needed - 1]
        assert torch.equal(bits(dst[:, :, last, tail:]), bits(before[:, :, last, tail:]))


def test_unpack_rejects_wrong_shape_dtype_and_short_block_table():
    cache = make_cache(4, 16, torch.bfloat16, seed=0)
    payload = pack_kv(cache, [0, 1], 20)
    with pytest.raises(ValueError, match="does not fit"):
        unpack_kv(cache, [2, 3], 21, payload)
    with pytest.raises(ValueError, match="does not fit"):
        unpack_kv(cache, [2, 3], 20, payload.float())
    with pytest.raises(ValueError, match="need 2 blocks"):
        unpack_kv(cache, [2], 20, payload)
    with pytest.raises(ValueError, match="out of range"):
        pack_kv(cache, [0, 9], 20)


def test_layout_check_compatible_names_every_difference():
    prefill = KVLayout.of(make_cache(2, 16, torch.bfloat16, seed=0), "m")
    assert prefill == KVLayout("m", LAYERS, HEADS, HEAD_DIM, 16, "torch.bfloat16")
    prefill.check_compatible(KVLayout.of(make_cache(7, 16, torch.bfloat16, seed=1), "m"))
    decode = KVLayout.of(make_cache(2, 32, torch.float32, seed=0), "m")
    with pytest.raises(ValueError) as info:
        prefill.check_compatible(decode)
    assert str(info.value) == ("prefill and decode pools differ: block_size 16 vs 32, "
                               "dtype torch.bfloat16 vs torch.float32")


def test_resolve_transport():
    assert resolve_transport("auto", torch.device("cpu")) == "object_store"
    assert resolve_transport("gloo", torch.device("cpu")) == "gloo"
    for bad in (lambda: resolve_transport("rdma", torch.device("cpu")), lambda: make_sender("rdma"),
                lambda: make_receiver("rdma")):
        with pytest.raises(ValueError, match="object_store, gloo, nccl"):
            bad()
    with pytest.raises(ValueError, match="nccl"):
        resolve_transport("nccl", torch.device("cpu"))


def test_resolve_transport_picks_by_where_the_peer_is():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_transport("auto", cuda, nccl=True) == "cuda_ipc+nccl"  # peer unknown: the receiver picks
    assert resolve_transport("auto", cuda, same_gpu=True, nccl=True) == "cuda_ipc"
    assert resolve_transport("auto", cuda, same_gpu=False, nccl=True) == "nccl"
    assert resolve_transport("auto", cuda, same_gpu=True, nccl=False) == "cuda_ipc"
    assert resolve_transport("auto", cuda, nccl=False) == "object_store"
    assert resolve_transport("auto", cuda, same_gpu=False, nccl=False) == "object_store"
    assert resolve_transport("auto", cpu, same_gpu=True, nccl=True) == "object_store"
    for explicit in ("object_store", "gloo", "nccl", "cuda_ipc", "cuda_ipc+nccl"):
        assert resolve_transport(explicit, cuda, same_gpu=False, nccl=True) == explicit
    assert resolve_transport("cuda_ipc", cpu) == "cuda_ipc"
    with pytest.raises(ValueError, match="cuda_ipc\\+nccl KV transport needs CUDA tensors and NCCL"):
        resolve_transport("cuda_ipc+nccl", cuda, nccl=False)
    with pytest.raises(ValueError, match="cuda_ipc KV transport shares CUDA"):
        resolve_transport("cuda_ipc", torch.device("meta"))
    assert make_sender("cuda_ipc").transport == "cuda_ipc"
    assert make_receiver("cuda_ipc", cpu).device == cpu


def _transport_threads() -> dict[str, int]:
    """Live threads of the p2p transports: our Python ones by name, and the native ones of gloo and the
    TCPStore by their OS thread name (Linux only)."""
    counts = {name: 0 for name in ("kv-sender", "kv-bye", "gloo", "pt_gloo", "pt_tcpstore")}
    for t in threading.enumerate():
        if t.name in counts:
            counts[t.name] += 1
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read()
        except OSError:  # the thread ended while we listed
            continue
        for prefix in ("gloo", "pt_gloo", "pt_tcpstore"):
            if comm.startswith(prefix + "_"):
                counts[prefix] += 1
    return counts


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts native threads in /proc")
def test_gloo_close_stops_every_thread_and_drops_the_pairs():
    cache = make_cache(4, 16, torch.float32, seed=0)
    before = _transport_threads()
    sender, receiver = P2PSender("gloo", host="127.0.0.1", timeout_s=10), P2PReceiver("gloo", host="127.0.0.1")
    for rid in ("a", "b"):
        payload, ticket = offer(sender, cache, rid)
        assert torch.equal(receiver.fetch(ticket, timeout_s=10), payload)
    running = _transport_threads()
    assert running["kv-sender"] == before["kv-sender"] + 1
    assert running["pt_gloo"] >= before["pt_gloo"] + 2 and running["pt_tcpstore"] > before["pt_tcpstore"]

    receiver.close()
    sender.close()
    gc.collect()
    assert _transport_threads() == before
    assert not receiver._pairs and not receiver._sender_locks and not sender._groups and not sender._payloads

    _, ticket = offer(sender, cache, "c")  # a closed sender starts afresh; a gone one fails the fetch
    receiver.fetch(offer(sender, cache, "d")[1], timeout_s=10)
    sender.close()
    with pytest.raises(KVTransferError):
        receiver.fetch(ticket, timeout_s=1)
    receiver.close()
    gc.collect()
    assert _transport_threads() == before


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    modules = [sys.modules[__name__], kv_transfer_helpers]  # workers cannot import these test modules
    for module in modules:
        ray_session.cloudpickle.register_pickle_by_value(module)
    yield ray_session
    for module in modules:
        ray_session.cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def engine(ray_cluster):
    return ray_cluster.remote(num_cpus=0, max_concurrency=4)(Engine)


class Engine:
    """An engine stand-in holding one KV cache and both ends of a transport."""

    def __init__(self, transport: str, seed: int) -> None:
        self.cache = make_cache(40, 16, torch.bfloat16, seed)
        self.layout = KVLayout.of(self.cache, "test-model")
        self.sender = make_sender(transport)
        self.receiver = make_receiver(transport)
        self.transport = transport

    def offer(self, request_id: str, block_ids: list[int], num_tokens: int):
        payload = pack_kv(self.cache, block_ids, num_tokens)
        meta = KVTransferMeta(request_id, num_tokens, self.layout, self.transport, payload.nbytes)
        return self.sender.offer(request_id, payload, meta)

    def release(self, request_id: str) -> None:
        self.sender.release(request_id)

    def fetch_unpack(self, ticket, block_ids: list[int], into_out: bool = False) -> float:
        start = time.monotonic()
        self.layout.check_compatible(ticket.meta.layout)
        out = torch.empty(ticket.meta.payload_shape, dtype=self.cache.dtype) if into_out else None
        payload = self.receiver.fetch(ticket, out=out)
        assert out is None or payload is out
        unpack_kv(self.cache, block_ids, ticket.meta.num_tokens, payload)
        return time.monotonic() - start

    def fetch_error(self, ticket, timeout_s: float) -> tuple[str, str, float]:
        start = time.monotonic()
        try:
            self.receiver.fetch(ticket, timeout_s=timeout_s)
        except Exception as e:
            return type(e).__name__, str(e), time.monotonic() - start
        return "", "fetched", time.monotonic() - start

    def tokens(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        return pack_kv(self.cache, block_ids, num_tokens)

    def pair_ids(self) -> list[str]:
        return [p.pair_id for p in getattr(self.receiver, "_pairs", {}).values()]

    def stats(self) -> tuple[dict, dict]:
        return self.sender.stats(), self.receiver.stats()

    def close(self) -> float:
        start = time.monotonic()
        self.receiver.close()
        self.sender.close()
        return time.monotonic() - start


def _assert_same_tokens(ray, a, a_ids, b, b_ids, num_tokens):
    sent, got = ray.get([a.tokens.remote(a_ids, num_tokens), b.tokens.remote(b_ids, num_tokens)])
    assert torch.equal(bits(sent), bits(got))


@pytest.mark.parametrize("transport", ["object_store", "gloo"])
def test_transfer_between_actors(ray_cluster, engine, transport):
    ray = ray_cluster
    prefill, decode = engine.remote(transport, seed=0), engine.remote(transport, seed=1)
    ticket = ray.get(prefill.offer.remote("r1", [3, 7, 1], 41))
    assert ticket.meta.nbytes == LAYERS * 2 * 41 * HEADS * HEAD_DIM * 2
    ray.get(decode.fetch_unpack.remote(ticket, [20, 5, 9]))
    _assert_same_tokens(ray, prefill, [3, 7, 1], decode, [20, 5, 9], 41)
    ray.get(prefill.release.remote("r1"))
    second = ray.get(prefill.offer.remote("r2", [11, 12], 32))
    ray.get(decode.fetch_unpack.remote(second, [0, 2], into_out=True))
    _assert_same_tokens(ray, prefill, [11, 12], decode, [0, 2], 32)
    ray.get(prefill.release.remote("r2"))
    sender_stats, _ = ray.get(prefill.stats.remote())
    _, receiver_stats = ray.get(decode.stats.remote())
    assert receiver_stats["transfers"] == 2 and receiver_stats["bytes"] == ticket.meta.nbytes + second.meta.nbytes
    assert sender_stats["transfers"] == 2
    assert ray.get(decode.close.remote()) < 5 and ray.get(prefill.close.remote()) < 5
    for actor in (prefill, decode):
        ray.kill(actor)


def test_gloo_concurrent_fetches_reuse_the_pair_and_fail_clearly(ray_cluster, engine):
    ray = ray_cluster
    prefill, decode = engine.remote("gloo", seed=0), engine.remote("gloo", seed=1)
    t1, t2 = ray.get([prefill.offer.remote("a", [0, 1, 2], 40), prefill.offer.remote("b", [5, 6], 17)])
    ray.get([decode.fetch_unpack.remote(t1, [30, 31, 32]), decode.fetch_unpack.remote(t2, [10, 11])])
    _assert_same_tokens(ray, prefill, [0, 1, 2], decode, [30, 31, 32], 40)
    _assert_same_tokens(ray, prefill, [5, 6], decode, [10, 11], 17)
    (pair,) = ray.get(decode.pair_ids.remote())

    t3 = ray.get(prefill.offer.remote("c", [9, 8, 7, 6], 64))  # second transfer: same pair group
    ray.get(decode.fetch_unpack.remote(t3, [1, 2, 3, 4]))
    _assert_same_tokens(ray, prefill, [9, 8, 7, 6], decode, [1, 2, 3, 4], 64)
    assert ray.get(decode.pair_ids.remote()) == [pair]

    kind, message, _ = ray.get(decode.fetch_error.remote(t3, 5))  # sent payloads are not kept
    assert kind == "KVTransferError" and "no KV payload for request 'c'" in message
    t4 = ray.get(prefill.offer.remote("d", [0], 5))
    ray.get(prefill.release.remote("d"))
    kind, message, _ = ray.get(decode.fetch_error.remote(t4, 5))
    assert kind == "KVTransferError" and "no KV payload for request 'd'" in message
    assert ray.get(decode.pair_ids.remote()) == [pair]  # a refusal keeps the connection
    sender_stats, _ = ray.get(prefill.stats.remote())
    assert sender_stats["transfers"] == 3 and sender_stats["bytes"] == sum(
        t.meta.nbytes for t in (t1, t2, t3))

    t5 = ray.get(prefill.offer.remote("e", [0], 5))
    ray.kill(prefill)
    time.sleep(0.5)
    kind, message, elapsed = ray.get(decode.fetch_error.remote(t5, 3))
    assert kind.startswith("KVTransfer") and "'e'" in message and f"{t5.host}:{t5.port}" in message
    assert elapsed < 10
    assert ray.get(decode.pair_ids.remote()) == []
    ray.kill(decode)


def test_gloo_fetch_from_a_sender_that_is_gone_times_out(ray_cluster, engine):
    ray = ray_cluster
    prefill, decode = engine.remote("gloo", seed=0), engine.remote("gloo", seed=1)
    ticket = ray.get(prefill.offer.remote("x", [0], 3))
    ray.kill(prefill)
    time.sleep(0.5)
    kind, message, elapsed = ray.get(decode.fetch_error.remote(ticket, 2))
    assert kind == "KVTransferTimeout" and "no KV payload of request 'x'" in message, message
    assert 1.5 < elapsed < 10
    ray.kill(decode)
