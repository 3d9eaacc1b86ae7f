"""One scheduling loop with one token budget per step: running requests first, then waiting ones.

There are no prefill and decode phases: a request owes `num_tokens - num_computed_tokens` tokens and gets
as many as the budget allows (a decode owes one). When the KV pool runs dry, the running request the
policy ranks lowest is preempted by recompute."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.kv_cache_manager import KVCacheManager
from workers.request import Request, RequestStatus
from workers.request_queue import RequestQueue


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class SchedulerOutput:
    """The step's work, in batch order. A request samples when its chunk reaches its last token."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, waiting: RequestQueue) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = waiting
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Siblings of an n>1 request wait here until their leader has computed the shared prompt.
        self.pending_forks: dict[str, list[Request]] = {}
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(v) for v in self.pending_forks.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request, siblings: list[Request] | None = None) -> None:
        """Queue a request; `siblings` share its prompt and start once the leader has computed it."""
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if siblings:
            for sib in siblings:
                self.requests[sib.request_id] = sib
            self.pending_forks[request.request_id] = list(siblings)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(req, num_new):
                j, victim = max(enumerate(self.running), key=lambda e: (self.waiting.key(e[1]), e[0]))
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break  # `i` now points at the next request
                if j < i:
                    i -= 1
            else:
                scheduled[req] = num_new
                budget -= num_new
                i += 1

        if not out.preempted:
            self._admit_waiting(scheduled, budget)

        for req in self.running:
            n = scheduled.get(req)
            if n:
                out.requests.append(req)
                out.num_new_tokens.append(n)
        return out

    def _admit_waiting(self, scheduled: dict[Request, int], budget: int) -> None:
        bs = self.kv_cache.block_size
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            computed = [] if req.block_ids else (self._sibling_blocks(req) or self.kv_cache.get_computed_blocks(req))
            num_computed = req.num_computed_tokens + len(computed) * bs
            num_new = req.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not self.kv_cache.allocate_slots(req, num_new, computed):
                break
            self.waiting.pop()
            req.fork_source = None
            self.kv_cache.record_prefix_query(req, len(computed) * bs)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req] = num_new
            budget -= num_new

    def _sibling_blocks(self, req: Request) -> list[int]:
        """Blocks of the live leader whose prompt this sibling shares; taken only on admission, so a
        waiting sibling never pins blocks."""
        src = req.fork_source
        if src is None or src.status is not RequestStatus.RUNNING:
            return []
        return self.kv_cache.shareable_prefix(req, src)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._release_siblings(req, share=False)
        self.waiting.prepend(req)

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        """Advance each scheduled request by its chunk; those that reached their end take a new token.
        Returns the requests that sampled, in batch order."""
        sampled: list[Request] = []
        tokens = iter(sampled_token_ids)
        for req, n in zip(out.requests, out.num_new_tokens):
            req.num_computed_tokens += n
            self.kv_cache.cache_computed_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                if req.request_id in self.pending_forks:
                    self._release_siblings(req, share=True)
                req.append_token(next(tokens))
                sampled.append(req)
        return sampled

    def _release_siblings(self, leader: Request, share: bool) -> None:
        for sib in self.pending_forks.pop(leader.request_id, []):
            sib.fork_source = leader if share else None
            self.waiting.add(sib)

    def finish_requests(self, requests: list[Request], status: RequestStatus, free_blocks: bool = True) -> None:
        """End requests (running, waiting or pending): free their blocks (unless the caller keeps them,
        as a prefill replica does until its KV is transferred) and forget them."""
        if not requests:
            return
        done = set(requests)
        self.running = [r for r in self.running if r not in done]
        for req in requests:
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and req in self.waiting:
                self.waiting.remove(req)
            for leader_id, sibs in list(self.pending_forks.items()):
                if req in sibs:
                    sibs.remove(req)
            self._release_siblings(req, share=False)
            if free_blocks:
                self.kv_cache.free(req)
            req.status = status
            self.requests.pop(req.request_id, None)
