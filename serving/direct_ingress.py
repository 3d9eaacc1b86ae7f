"""Serve's direct ingress as kvrelay uses it: the engine's replica answers HTTP on the app's port itself.

Ray 2.60's replica binds its direct-ingress port without `SO_REUSEADDR`
(`start_asgi_http_server(..., enable_so_reuseport=False)` in `ray/serve/_private/replica.py`), where Serve's
proxy, like uvicorn, binds with it. Without it a replacement replica cannot listen on the port while the dead
one's closed connections sit in TIME_WAIT: a minute of refused connections after a crash, and a restart of
`kvrelay serve` on a port that has just served waits the same minute. `bind_reusing_address`, called in the
ingress replica's process before Serve starts that server, has it bind with `SO_REUSEADDR` alone: a closed
connection no longer holds the port, and a socket that still listens on it still does (no `SO_REUSEPORT`).
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import socket

logger = logging.getLogger("ray.serve")

ENABLE_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


def enabled() -> bool:
    """Whether this process's Serve runs direct ingress (read from the environment Ray started with)."""
    return os.environ.get(ENABLE_ENV) == "1"


def env(port: int) -> dict[str, str]:
    """Ray Serve settings under which an ingress replica serves HTTP on `port` itself (Serve's direct
    ingress) rather than behind Serve's proxy: the replica's port range is that one port; a port freed by a
    stopped replica is not held back for a load balancer (a replacement replica takes it at once); a replica
    that stops does not keep its port open for a load balancer to notice (`kvrelay serve` drains requests
    itself). Read by Serve's processes when they start, so set in the environment before Ray starts."""
    return {
        ENABLE_ENV: "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # the range's end is not in it
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def _serve_modules():
    """Serve's replica and HTTP modules when they have the two functions changed here with the arguments
    used, else None (another Ray release)."""
    try:
        from ray.serve._private import http_util, replica
    except ImportError:
        return None
    start = getattr(replica, "start_asgi_http_server", None)
    if start is None or not callable(getattr(http_util, "set_socket_reuse_port", None)):
        return None
    params = inspect.signature(start).parameters
    if not {"app", "http_options", "event_loop", "enable_so_reuseport"} <= set(params):
        return None
    return replica, http_util


def can_bind_reusing_address() -> bool:
    """Whether `bind_reusing_address` works with the Ray installed here."""
    return _serve_modules() is not None


def _set_reuse_address(sock: socket.socket) -> bool:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return True


def bind_reusing_address() -> bool:
    """Have this process's Serve replica bind its direct-ingress HTTP port with `SO_REUSEADDR` only (the
    module's docstring says why). Idempotent; False, with a warning, where this Ray lacks the functions."""
    modules = _serve_modules()
    if modules is None:
        logger.warning("kvrelay: this Ray's Serve replica binds its direct-ingress port without SO_REUSEADDR; "
                       "after a crash its replacement may wait for TIME_WAIT (about a minute) to listen")
        return False
    replica, http_util = modules
    original = replica.start_asgi_http_server
    if getattr(original, "_kvrelay_reuse_address", False):
        return True

    @functools.wraps(original)
    async def start_asgi_http_server(app, http_options, *, event_loop, enable_so_reuseport: bool = False):
        # The replica passes False; Serve's option then runs `set_socket_reuse_port`, which in this process
        # sets SO_REUSEADDR alone (the replica's process has no other caller of it).
        return await original(app, http_options, event_loop=event_loop, enable_so_reuseport=True)

    start_asgi_http_server._kvrelay_reuse_address = True
    http_util.set_socket_reuse_port = _set_reuse_address
    replica.start_asgi_http_server = start_asgi_http_server
    return True
