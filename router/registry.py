"""Which engine replicas this process's request router knows, for callers that must reach every replica
(the ingress scraping `/metrics`). Kept apart from `request_router.py` because Serve ships the router
class by value, which would give it its own copy of any state defined beside it."""

from __future__ import annotations

import threading
from typing import Any

_routers: dict[str, Any] = {}
_lock = threading.Lock()


def register(deployment_name: str, router: Any) -> None:
    with _lock:
        _routers[deployment_name] = router


def known_replica_ids(deployment_name: str) -> set[str] | None:
    """Ids of the replicas this process's router may route to (a stopping or dead replica has left the
    set); None when no router for the deployment exists here yet."""
    with _lock:
        router = _routers.get(deployment_name)
    if router is None:
        return None
    return {r.unique_id for r in list(router._replica_id_set)}


def replica_ids(deployment_name: str) -> list[str]:
    """Ids of the replicas known for a deployment (empty before the first call through a handle)."""
    return sorted(known_replica_ids(deployment_name) or ())
