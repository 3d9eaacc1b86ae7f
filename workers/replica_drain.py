"""How an engine replica learns that Serve has begun stopping it (scale-down, redeploy, shutdown), so it
can end what still runs `drain_timeout_s` later by its own clock, however late its callers' routers hear
of the stop (Serve's long poll lagged tens of seconds on a loaded host)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import ray

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.5


class ReplicaStopping(RuntimeError):
    """Serve is stopping the replica and the request did not finish within `drain_timeout_s`."""


def serve_stop_flag() -> Callable[[], bool] | None:
    """A reader of the flag Serve sets on this replica when its graceful shutdown starts, or None outside
    a Serve replica. Serve offers no public hook for that moment; the flag is the replica's
    `_shutting_down`, which Serve documents as meant for replica implementations to read."""
    if not ray.is_initialized():  # no Ray here; asking for the runtime context would leave a later ray.init failing
        return None
    try:
        actor_id = ray.get_runtime_context().get_actor_id()
        if actor_id is None:
            return None
        actor = ray._private.worker.global_worker.actors.get(ray.ActorID.from_hex(actor_id))
        replica = getattr(actor, "_replica_impl", None)
    except Exception:  # not in a Ray actor, or this Ray keeps its actors elsewhere
        return None
    if not isinstance(getattr(replica, "_shutting_down", None), bool):
        if actor is not None:
            logger.warning("cannot see when Serve stops this replica (Ray %s); requests still running when it "
                           "stops are ended by the ingress instead", ray.__version__)
        return None
    return lambda: replica._shutting_down
