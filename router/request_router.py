"""Ray Serve request router for engine replicas (Serve's `RequestRouter` extension point).

It runs inside every process that holds a handle to the engine deployment (the ingress). Calls that
carry `replica_id=` are pinned to that replica (per-replica subscriber streams, metrics scrapes); every
other call carries a `GenerateRequest` and goes to the replica `router.policy.rank_replicas` puts first."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from router import registry
from router.policy import AFFINITY_SLACK_TOKENS, PrefixAffinity, ReplicaLoad, rank_replicas
from workers.messages import GenerateRequest

def _generate_request(pending: PendingRequest) -> GenerateRequest | None:
    for value in (*pending.args, *pending.kwargs.values()):
        if isinstance(value, GenerateRequest):
            return value
    return None


class KVRelayRequestRouter(RequestRouter):
    def initialize_state(self, affinity_slack_tokens: float = AFFINITY_SLACK_TOKENS, **_: Any) -> None:
        self.affinity = PrefixAffinity()
        self.affinity_slack_tokens = affinity_slack_tokens
        registry.register(self._deployment_id.name, self)

    def _ensure_state(self) -> None:
        if not hasattr(self, "affinity"):
            self.initialize_state()

    def load_of(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        ongoing = self._replica_queue_len_cache.get(replica.replica_id) or 0
        return ReplicaLoad(replica.replica_id.unique_id, int(stats.get("pending_tokens", 0)),
                           float(stats.get("kv_cache_usage", 0.0)), ongoing)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._ensure_state()
        if pending_request is None:
            return [candidate_replicas]
        pinned = pending_request.kwargs.get("replica_id")
        if pinned is not None:
            match = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            return [match] if match else []
        request = _generate_request(pending_request)
        if request is None:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        affinity = self.affinity.lookup(request.prompt_token_ids, set(by_id))
        order = rank_replicas([self.load_of(r) for r in candidate_replicas], affinity, self.affinity_slack_tokens)
        return [[by_id[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self._ensure_state()
        request = _generate_request(pending_request)
        if request is not None:
            self.affinity.record(request.prompt_token_ids, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._ensure_state()
        self.affinity.forget(replica_id.unique_id)
