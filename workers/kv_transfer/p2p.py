"""The `gloo` and `nccl` KV transports: point to point (NCCL for CUDA tensors) over a two-rank process
group made per (sender, receiver) pair, without `init_process_group`, so replicas can come and go.

Point-to-point protocol over the sender's TCPStore (every message is JSON pushed to the queue `kvt/inbox`,
served in order by one sender thread):
  - receiver: `{"op": "hello", "pair": P}`, then builds its side of a gloo group (rank 1) over the store
    prefix `kvt/pair/P/`; the sender builds rank 0 when it pops the hello.
  - receiver: `{"op": "want", "pair": P, "tag": n, "req": request_id}`, then waits for the key
    `kvt/reply/P/n`; the sender sets it to `{"ok": true}` and sends the payload with tag n (then drops
    it), or to `{"ok": false, "error": ..., "reconnect": ...}` when it holds no payload for that request
    or no group for that pair. Tags keep concurrent fetches on one pair apart (NCCL ignores tags, so a
    receiver serializes its NCCL fetches per pair). Every wait is bounded by the fetch's timeout.
  - receiver: `{"op": "bye", "pair": P}` on close or after a failed fetch; the sender drops its side.
  - sender: `{"op": "stop"}` to its own queue on close.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from workers.kv_transfer.base import KVReceiver, KVSender, KVTransferError, KVTransferTimeout
from workers.kv_transfer.layout import KVTransferMeta

logger = logging.getLogger(__name__)
INBOX = "kvt/inbox"
BYE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class P2PTicket:
    """Header plus where the sender's rendezvous store listens and which sender it is."""

    meta: KVTransferMeta
    host: str
    port: int
    sender_id: str


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _node_ip() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


def _pair_group(backend: str, store: Any, rank: int, host: str, timeout_s: float) -> Any:
    """One side of a standalone two-rank group (rank 0 = sender) over `store`; blocks until both join."""
    prefixed = dist.PrefixStore("kvt/group/", store)
    if backend == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = _timedelta(timeout_s)
        return ProcessGroupNCCL(prefixed, rank, 2, options)
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = _timedelta(timeout_s)
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._threads = 1  # its worker threads serve collectives; send/recv run on the caller's thread
    return ProcessGroupGloo(prefixed, rank, 2, options)


def _wait_done(work: Any, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
    """Block until a send/recv has finished (NCCL's wait only orders the current CUDA stream)."""
    if timeout_s is None:
        work.wait()
    else:
        work.wait(_timedelta(max(timeout_s, 0.001)))
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class P2PSender(KVSender):
    """Serves payloads to receivers over per-pair gloo/NCCL groups; a payload is dropped once sent."""

    def __init__(self, backend: str = "gloo", host: str | None = None, timeout_s: float = 30) -> None:
        super().__init__()
        self.transport = backend
        self.sender_id = ""
        self.timeout_s = timeout_s
        self._host = host
        self._store: Any = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._payloads: dict[str, torch.Tensor] = {}
        self._groups: dict[str, Any] = {}

    def offer(self, request_id: str, payload: torch.Tensor, meta: KVTransferMeta) -> P2PTicket:
        self._check_offer(request_id, payload, meta)
        if self.transport == "nccl" and not payload.is_cuda:
            raise ValueError(f"the nccl KV transport sends CUDA tensors, got one on {payload.device}")
        self._start()
        with self._lock:
            if request_id in self._payloads:
                raise ValueError(f"request {request_id!r} already has a KV payload on offer")
            self._payloads[request_id] = (payload.cpu() if self.transport == "gloo" else payload).contiguous()
        return P2PTicket(meta, self._host, self._store.port, self.sender_id)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._payloads.pop(request_id, None)

    def close(self) -> None:
        """Stop the serving thread, then end every pair group and drop the store and the payloads on offer."""
        with self._lock:
            thread, store = self._thread, self._store
        if thread is not None:
            store.queue_push(INBOX, json.dumps({"op": "stop"}))
            limit_s = self.timeout_s + 1.0  # a send or a group rendezvous in progress ends within timeout_s
            thread.join(timeout=limit_s)
            if thread.is_alive():
                logger.warning("KV sender %s: its serving thread is still busy after %g s; closing anyway",
                               self.sender_id, limit_s)
        with self._lock:
            self._thread, self._store = None, None
            self._payloads.clear()
        groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            _end_group(group)

    def _start(self) -> None:
        """Host the rendezvous store and start the serving thread, once."""
        with self._lock:
            if self._thread is not None:
                return
            self.sender_id = uuid.uuid4().hex  # a restart after close() is a new sender to receivers
            self._host = self._host or _node_ip()
            self._store = dist.TCPStore(self._host, 0, is_master=True, timeout=_timedelta(self.timeout_s),
                                        wait_for_workers=False)
            # The thread's own clients: one parked on the inbox, one (with the short timeout) for the rest.
            inbox, store = self._store.clone(), self._store.clone()
            inbox.set_timeout(datetime.timedelta(days=1))
            self._thread = threading.Thread(target=self._serve, args=(inbox, store), name="kv-sender",
                                            daemon=True)
            self._thread.start()

    def _serve(self, inbox: Any, store: Any) -> None:
        """Handle inbox messages one at a time until told to stop."""
        while True:
            try:
                msg = json.loads(inbox.queue_pop(INBOX))
            except dist.DistStoreError:
                continue
            except dist.DistNetworkError:
                return
            if msg["op"] == "stop":
                return
            try:
                self._handle(store, msg)
            except Exception:
                logger.exception("KV sender %s failed on %s", self.sender_id, msg)

    def _handle(self, store: Any, msg: dict[str, Any]) -> None:
        op, pair = msg["op"], msg["pair"]
        if op == "hello":
            pair_store = dist.PrefixStore(f"kvt/pair/{pair}/", store)
            self._groups[pair] = _pair_group(self.transport, pair_store, 0, self._host, self.timeout_s)
        elif op == "bye":
            self._drop_group(pair)
        elif op == "want":
            self._send(store, pair, msg["tag"], msg["req"])

    def _send(self, store: Any, pair: str, tag: int, request_id: str) -> None:
        """Answer one fetch: an error reply, or an ok reply followed by the payload under the fetch's tag."""
        reply = f"kvt/reply/{pair}/{tag}"
        with self._lock:
            payload = self._payloads.get(request_id)
        group = self._groups.get(pair)
        if group is None:
            error = "the receiver is not connected (its group was dropped after a failure); fetch again"
        elif payload is None:
            error = f"no KV payload for request {request_id!r} (never offered, already sent, or released)"
        if group is None or payload is None:
            store.set(reply, json.dumps({"ok": False, "error": error, "reconnect": group is None}))
            return
        store.set(reply, json.dumps({"ok": True}))
        start = time.perf_counter()
        try:
            _wait_done(group.send([payload], 1, tag), payload)
        except Exception:
            self._stats.error()
            self._drop_group(pair)
            raise
        self._stats.record(payload.nbytes, time.perf_counter() - start)
        self.release(request_id)

    def _drop_group(self, pair: str) -> None:
        group = self._groups.pop(pair, None)
        if group is not None:
            _end_group(group)


@dataclass
class _Pair:
    """The receiver's end of one sender: a store client, the group, and the next free tag."""

    pair_id: str
    store: Any
    group: Any
    next_tag: int = 0
    tag_lock: threading.Lock = field(default_factory=threading.Lock)
    order_lock: threading.Lock = field(default_factory=threading.Lock)

    def take_tag(self) -> int:
        with self.tag_lock:
            self.next_tag += 1
            return self.next_tag


class P2PReceiver(KVReceiver):
    """Fetches payloads from P2PSenders, connecting to each sender once and reusing the pair group."""

    def __init__(self, backend: str = "gloo", host: str | None = None) -> None:
        super().__init__()
        self.transport = backend
        self._host = host
        self._pairs: dict[str, _Pair] = {}
        self._connect_lock = threading.Lock()
        self._sender_locks: dict[str, threading.Lock] = {}
        self._byes: list[threading.Thread] = []

    @property
    def device(self) -> torch.device:
        if self.transport == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def fetch(self, ticket: P2PTicket, out: torch.Tensor | None = None, timeout_s: float = 30) -> torch.Tensor:
        meta = ticket.meta
        self._check_ticket(meta, out)
        start = time.perf_counter()
        try:
            buffer = self._fetch(ticket, out, timeout_s)
        except Exception:
            self._stats.error()
            raise
        if out is not None and buffer is not out:
            buffer = out.copy_(buffer)
        self._stats.record(meta.nbytes, time.perf_counter() - start)
        return buffer

    def close(self) -> None:
        """Say bye to every sender and end each pair group, then wait for the byes of failed pairs."""
        with self._connect_lock:
            pairs, self._pairs = list(self._pairs.values()), {}
            byes, self._byes = self._byes, []
            self._sender_locks.clear()
        for pair in pairs:
            _say_bye(pair)
        for bye in byes:
            bye.join(timeout=2 * BYE_TIMEOUT_S)

    def _fetch(self, ticket: P2PTicket, out: torch.Tensor | None, timeout_s: float) -> torch.Tensor:
        """Connect if needed, then ask and receive; any failure but a refusal drops the pair."""
        deadline = time.monotonic() + timeout_s
        where = f"KV sender {ticket.sender_id[:8]} at {ticket.host}:{ticket.port}"
        what = f"KV payload of request {ticket.meta.request_id!r} from {where}"
        pair = None
        try:
            pair = self._pair(ticket, deadline)
            answer, buffer = self._ask_and_recv(ticket, pair, out, deadline)
        except Exception as e:
            if pair is not None:
                self._forget(ticket.sender_id, pair)
            if time.monotonic() >= deadline - 0.05:
                raise KVTransferTimeout(f"no {what} within {timeout_s:g} s: {e}") from e
            raise KVTransferError(f"fetching the {what} failed: {e}") from e
        if not answer["ok"]:
            if answer["reconnect"]:
                self._forget(ticket.sender_id, pair)
            raise KVTransferError(f"{where} refused request {ticket.meta.request_id!r}: {answer['error']}")
        return buffer

    def _pair(self, ticket: P2PTicket, deadline: float) -> _Pair:
        """The pair for this ticket's sender, connecting (hello + group rendezvous) on first use."""
        with self._connect_lock:
            lock = self._sender_locks.setdefault(ticket.sender_id, threading.Lock())
        if not lock.acquire(timeout=_left(deadline)):
            raise TimeoutError("still connecting to this sender from another fetch")
        try:
            pair = self._pairs.get(ticket.sender_id)
            if pair is None:
                pair = self._connect(ticket, _left(deadline))
                with self._connect_lock:
                    self._pairs[ticket.sender_id] = pair
            return pair
        finally:
            lock.release()

    def _connect(self, ticket: P2PTicket, timeout_s: float) -> _Pair:
        self._host = self._host or _node_ip()
        store = _client(ticket, timeout_s)
        pair_id = uuid.uuid4().hex
        store.queue_push(INBOX, json.dumps({"op": "hello", "pair": pair_id}))
        pair_store = dist.PrefixStore(f"kvt/pair/{pair_id}/", store)
        return _Pair(pair_id, store, _pair_group(self.transport, pair_store, 1, self._host, timeout_s))

    def _forget(self, sender_id: str, pair: _Pair) -> None:
        """Drop a pair after a failure; the bye goes out in the background as the sender may be gone."""
        with self._connect_lock:
            if self._pairs.get(sender_id) is pair:
                del self._pairs[sender_id]
                self._byes = [bye for bye in self._byes if bye.is_alive()]
                bye = threading.Thread(target=_say_bye, args=(pair,), name="kv-bye", daemon=True)
                self._byes.append(bye)
                bye.start()

    def _ask_and_recv(self, ticket: P2PTicket, pair: _Pair, out: torch.Tensor | None,
                      deadline: float) -> tuple[dict[str, Any], torch.Tensor]:
        """Push a `want`, wait for the sender's reply, then receive the payload under the fetch's tag."""
        meta, tag = ticket.meta, pair.take_tag()
        reusable = out is not None and out.device == self.device and out.is_contiguous()
        buffer = out if reusable else torch.empty(meta.payload_shape, dtype=meta.layout.torch_dtype,
                                                  device=self.device)
        # A client per fetch: a blocking wait holds its client, and one fetch's wait must not stall another's.
        store = _client(ticket, _left(deadline))
        reply = f"kvt/reply/{pair.pair_id}/{tag}"
        with pair.order_lock if self.transport == "nccl" else nullcontext():
            store.queue_push(INBOX, json.dumps({"op": "want", "pair": pair.pair_id, "tag": tag,
                                                "req": meta.request_id}))
            store.wait([reply], _timedelta(_left(deadline)))
            answer = json.loads(store.get(reply))
            store.delete_key(reply)
            if answer["ok"]:
                _wait_done(pair.group.recv([buffer], 0, tag), buffer, _left(deadline))
        return answer, buffer


def _say_bye(pair: _Pair) -> None:
    """Tell the sender to drop its side of the pair (best effort), then end this side once no NCCL fetch
    is using it."""
    try:
        pair.store.set_timeout(_timedelta(BYE_TIMEOUT_S))
        pair.store.queue_push(INBOX, json.dumps({"op": "bye", "pair": pair.pair_id}))
    except Exception:
        logger.debug("KV sender of pair %s is gone", pair.pair_id)
    with pair.order_lock:
        _end_group(pair.group)


def _end_group(group: Any) -> None:
    """Shut one side of a pair group down now: NCCL frees its communicator only on shutdown (dropping the
    last reference leaks it), gloo's threads end when the group is released."""
    try:
        group.shutdown()
    except Exception:
        logger.debug("shutting down a KV pair group failed", exc_info=True)


def _client(ticket: P2PTicket, timeout_s: float) -> Any:
    """A new client of the ticket's sender store; connecting retries until `timeout_s`."""
    return dist.TCPStore(ticket.host, ticket.port, is_master=False, timeout=_timedelta(timeout_s),
                         wait_for_workers=False)


def _left(deadline: float) -> float:
    """Seconds until `deadline`, at least a millisecond (a zero timeout means "forever" to some calls)."""
    return max(deadline - time.monotonic(), 0.001)
