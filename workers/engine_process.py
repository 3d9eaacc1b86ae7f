"""The engine loop in a process of its own: `EngineWorker(engine_process=True)` (`--engine-process`).

In one process the engine's thread and the replica's event loop (HTTP, SSE events, the client's streams)
take turns at one interpreter lock. At a GPU's token rate the loop's per-chunk Python is the bottleneck, and
every step the engine thread spends in the scheduler, sampler and detokenizer is time the loop waits (a
py-spy profile of a streamed burst on a fast model put the loop at ~70% of the lock). vLLM runs its engine
core in a separate process for this reason. Here the child runs the unchanged `EngineLoop` (its engine, its
thread, its inbox); the replica keeps `EngineLoop`'s interface through `EngineProcess`:

- one socket pair; each message is one pickle (`pickle.dumps`, protocol 5: a tensor's bytes go by value, so
  no shared-memory handles outlive their sender);
- replica -> child: `add` (a request and its KV import), `abort`, `release` (a held prefill's KV), `check`
  (the runner's liveness, for the health check) and `stop`;
- child -> replica: `built` (the engine's facts) or `failed` once, then one `step` per engine step with its
  outputs, errors, KV exports and stats, read by a thread of the replica that calls `publish` as the
  in-process loop's thread would.

The child ends with the replica: it stops when its socket closes (the replica exited or was killed).
Admission reads the child's last stats plus the requests sent since: each `step` message names how many
`add`s the child had taken when it was made."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection

from workers.config import EngineConfig
from workers.engine import EngineStats, KVImport
from workers.engine_loop import Arrivals, EngineFacts, EngineLoop, Publish
from workers.messages import GenerateRequest

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # building the engine: loading weights, the warm-up, compiling kernels


def _send(conn: Connection, lock: threading.Lock, message: tuple) -> None:
    data = pickle.dumps(message, protocol=5)
    with lock:
        conn.send_bytes(data)


def _recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


@dataclass(slots=True)
class _Step:
    """What the replica knows of the child from its last `step` message."""

    stats: EngineStats
    arrived: Arrivals  # taken by the child's loop, not yet counted in `stats`
    adds_taken: int  # `add` messages the child had received
    consecutive_failed_steps: int
    unavailable: str | None


class EngineProcess:
    """`EngineLoop`'s interface over a child process that runs one."""

    def __init__(self, config: EngineConfig, publish: Publish, on_exit: Callable[[int | None], None] | None = None,
                 ) -> None:
        self.config = config
        self._publish = publish
        self._on_exit = on_exit  # called (with the exit code) when the child ends unasked
        self.facts: EngineFacts | None = None  # set by `start`
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards `_last`, `_sent` and `_unacked`
        self._last: _Step | None = None
        self._sent = 0  # `add` messages sent
        self._unacked: deque[tuple[int, Arrivals]] = deque()  # (its number, what it adds) of adds not yet taken
        self._checks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._check_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._stopped = False

    # ---- EngineLoop's interface ------------------------------------------------------------------

    def start(self) -> None:
        """Start the child; returns once its engine is built (raising what building raised)."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "workers.engine_process", str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        _send(self._conn, self._send_lock, ("config", self.config))
        if not self._conn.poll(START_TIMEOUT_S):
            self._kill()
            raise TimeoutError(f"the engine process built no engine within {START_TIMEOUT_S:g} s")
        try:
            kind, *rest = _recv(self._conn)
        except EOFError:
            code = self._proc.wait()
            raise RuntimeError(f"the engine process exited with code {code} before its engine was built") from None
        if kind == "failed":
            self._proc.wait()
            raise rest[0]
        self.facts, stats = rest
        self._last = _Step(stats, Arrivals(), 0, 0, None)
        self._reader = threading.Thread(target=self._read, name="kvrelay-engine-process", daemon=True)
        self._reader.start()

    def is_alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def exit_code(self) -> int | None:
        """The child's exit code once it has ended (negative: the signal that ended it), else None."""
        return self._proc.poll()

    def close_socket(self) -> None:
        """Hang up the replica's end, as the replica's death would: the child stops (for tests)."""
        self._stopped = True
        with socket.socket(fileno=os.dup(self._conn.fileno())) as end:
            end.shutdown(socket.SHUT_RDWR)
        self._reader.join(timeout=5)
        self._conn.close()

    def stop(self) -> None:
        if self._proc is None or self._stopped:
            return
        self._stopped = True
        try:
            _send(self._conn, self._send_lock, ("stop",))
        except OSError:
            pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._conn.close()

    @property
    def stats(self) -> EngineStats:
        return self._last.stats

    @property
    def consecutive_failed_steps(self) -> int:
        return self._last.consecutive_failed_steps

    @property
    def unavailable(self) -> str | None:
        return self._last.unavailable

    @property
    def num_waiting(self) -> int:
        stats, arrived = self.load()
        return stats.num_waiting + arrived.num_seqs

    def load(self) -> tuple[EngineStats, Arrivals]:
        with self._lock:
            arrived = self._last.arrived
            for _, a in self._unacked:
                arrived = arrived + a
            return self._last.stats, arrived

    def add(self, request: GenerateRequest, kv_import: KVImport | None = None) -> None:
        arrival = Arrivals()
        arrival.add(request)
        with self._lock:
            self._sent += 1
            self._unacked.append((self._sent, arrival))
        self._send(("add", request, kv_import))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def release_kv(self, request_id: str) -> None:
        self._send(("release", request_id))

    async def check_alive(self) -> None:
        """The child's runner is alive (`ModelRunner.check_alive`: its tensor-parallel ranks)."""
        if not self.is_alive():
            raise RuntimeError("the engine process has exited")
        aio = asyncio.get_running_loop()
        token, done = next(self._check_ids), aio.create_future()
        self._checks[token] = (aio, done)
        try:
            self._send(("check", token))
            error = await done
        finally:
            self._checks.pop(token, None)
        if error is not None:
            raise error

    # ---- internals -------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            _send(self._conn, self._send_lock, message)
        except OSError:  # the child is gone: the health check reports it (`is_alive`)
            logger.warning("the engine process is gone; dropped a %r message", message[0])

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def _read(self) -> None:
        """The replica's side of the child's messages, until its socket closes."""
        while True:
            try:
                kind, *rest = _recv(self._conn)
            except (EOFError, OSError):
                break
            if kind == "step":
                outputs, errors, exports, step = rest
                with self._lock:
                    self._last = step
                    while self._unacked and self._unacked[0][0] <= step.adds_taken:
                        self._unacked.popleft()
                try:
                    self._publish(outputs, errors, step.stats, exports)
                except Exception:
                    logger.exception("publishing an engine step failed")
            elif kind == "checked":
                token, error = rest
                waiter = self._checks.get(token)
                if waiter is not None:
                    aio, done = waiter
                    aio.call_soon_threadsafe(lambda d=done, e=error: d.done() or d.set_result(e))
        for aio, done in list(self._checks.values()):
            aio.call_soon_threadsafe(lambda d=done: d.done() or d.set_result(RuntimeError("the engine process exited")))
        if self._stopped:
            return
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it closed its socket but lives on: end it
            self._kill()
            code = self._proc.returncode
        logger.error("the engine process ended (exit code %s)", code)
        if self._on_exit is not None:
            self._on_exit(code)


def _child(fd: int) -> None:
    """The engine process: an `EngineLoop` fed by the replica's messages."""
    from workers.engine import Engine

    conn = Connection(fd)
    lock = threading.Lock()
    kind, config = _recv(conn)
    ready = threading.Event()
    taken = 0
    loop: EngineLoop | None = None

    def publish(outputs, errors, stats, exports) -> None:
        ready.wait()
        adds = taken  # read before the load: an add between the two is counted twice, never missed
        stats, arrived = loop.load()
        for out in outputs:  # the ingress has the prompt; do not send it every step
            out.prompt, out.prompt_token_ids = None, []
        step = _Step(stats, arrived, adds, loop.consecutive_failed_steps, loop.engine.runner.unavailable)
        _send(conn, lock, ("step", outputs, errors, exports, step))

    def check(token: int) -> None:
        try:
            asyncio.run(loop.engine.runner.check_alive())
            error = None
        except Exception as e:  # noqa: BLE001 - the replica's health check raises it
            error = e
        _send(conn, lock, ("checked", token, error))

    loop = EngineLoop(partial(Engine, config), publish)
    try:
        loop.start()
    except BaseException as e:  # noqa: BLE001 - the replica raises it
        _send(conn, lock, ("failed", e))
        return
    _send(conn, lock, ("built", EngineFacts.of(loop.engine), loop.stats))
    ready.set()
    try:
        while True:
            try:
                kind, *rest = _recv(conn)
            except (EOFError, OSError):
                break
            if kind == "add":
                loop.add(*rest)
                taken += 1
            elif kind == "abort":
                loop.abort(rest[0])
            elif kind == "release":
                loop.release_kv(rest[0])
            elif kind == "check":  # off this thread: a slow check must not hold up requests
                threading.Thread(target=check, args=(rest[0],), name="kvrelay-engine-check", daemon=True).start()
            elif kind == "stop":
                break
    finally:
        loop.stop()
        loop.engine.shutdown()


if __name__ == "__main__":
    from workers.engine_process import _child as child  # this module by its name, so its classes pickle by it

    child(int(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # the engine's daemon threads and OpenMP pools need no orderly end
