"""Where a request runs: the least-loaded replica, with prefix affinity breaking near-ties.

Pure functions and a small LRU, so the decision is testable without Ray."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# A request in flight costs about this many tokens of work on top of the prefill backlog.
TOKENS_PER_ONGOING_REQUEST = 32
# A replica whose KV cache is this full is chosen only when every replica is.
KV_PRESSURE = 0.95
# The replica that holds a request's prefix wins if it is at most this many tokens busier than the best.
AFFINITY_SLACK_TOKENS = 256
# Prefix lengths (tokens) remembered for affinity, longest matched first.
PREFIX_LENGTHS = (32, 128, 512)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a replica reported (`pending_tokens`, `kv_cache_usage`) plus what this router knows
    (`ongoing_requests`, fresher than the periodic report)."""

    replica_id: str
    pending_tokens: int = 0
    kv_cache_usage: float = 0.0
    ongoing_requests: int = 0

    @property
    def score(self) -> float:
        return self.pending_tokens + TOKENS_PER_ONGOING_REQUEST * self.ongoing_requests

    @property
    def under_pressure(self) -> bool:
        return self.kv_cache_usage >= KV_PRESSURE


def rank_replicas(loads: Sequence[ReplicaLoad], affinity: str | None = None,
                  slack: float = AFFINITY_SLACK_TOKENS) -> list[str]:
    """Replica ids, best first: replicas under KV pressure last, then by load score; the affinity replica
    moves to the front when its score is within `slack` of the best and it is not under pressure."""
    order = sorted(loads, key=lambda l: (l.under_pressure, l.score, l.replica_id))
    ids = [l.replica_id for l in order]
    if affinity is not None and order:
        best = order[0]
        for load in order:
            if load.replica_id == affinity:
                if not load.under_pressure and load.score <= best.score + slack:
                    ids.remove(affinity)
                    ids.insert(0, affinity)
                break
    return ids


class PrefixAffinity:
    """Remembers which replica last received each prompt prefix (bounded LRU)."""

    def __init__(self, capacity: int = 16384, lengths: Sequence[int] = PREFIX_LENGTHS) -> None:
        self.capacity = capacity
        self.lengths = tuple(sorted(lengths, reverse=True))
        self._where: OrderedDict[tuple[int, ...], str] = OrderedDict()

    def _keys(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        return [tuple(token_ids[:n]) for n in self.lengths if len(token_ids) >= n]

    def lookup(self, token_ids: Sequence[int], live: set[str] | None = None) -> str | None:
        """The replica that holds the longest remembered prefix of `token_ids` (among `live` ones)."""
        for key in self._keys(token_ids):
            replica = self._where.get(key)
            if replica is not None and (live is None or replica in live):
                self._where.move_to_end(key)
                return replica
        return None

    def record(self, token_ids: Sequence[int], replica_id: str) -> None:
        for key in self._keys(token_ids):
            self._where[key] = replica_id
            self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        for key in [k for k, r in self._where.items() if r == replica_id]:
            del self._where[key]
