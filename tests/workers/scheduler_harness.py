"""A fake engine loop over the real scheduler and KV cache manager that checks every invariant
after every step; shared by the scheduler tests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest

from workers.kv_cache_manager import KVCacheManager
from workers.request import Request, RequestStatus
from workers.request_queue import SchedulingPolicy, make_request_queue
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig

POLICIES = SchedulingPolicy.names()


def make_req(rid: str, prompt: list[int], max_tokens: int, arrival: float, priority: int = 0) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), max_tokens=max_tokens,
                   arrival_time=arrival, priority=priority)


def kv_value(tokens: list[int], p: int) -> int:
    """What position `p`'s KV entry holds: a function of every token up to and including it."""
    return hash(tuple(tokens[:p + 1]))


def fake_token(tokens: list[int]) -> int:
    return hash(tuple(tokens)) % 1000


@dataclass
class Spec:
    """One request (a leader) and its siblings, arriving at `arrival`."""
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    priority: int = 0
    num_siblings: int = 0


@dataclass
class Result:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    first_scheduled: list[str] = field(default_factory=list)
    num_preemptions: int = 0
    steps: int = 0


class Harness:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked: bool = True, prefix_caching: bool = True, policy: str = "fcfs") -> None:
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked, max_model_len=1 << 20)
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.config, self.kv, make_request_queue(policy))
        self.pool = self.kv.pool
        self.bs = block_size
        self.num_blocks = num_blocks
        self.chunked = chunked
        self.slots: dict[int, list[int | None]] = {b: [None] * block_size for b in range(num_blocks)}
        self.all: dict[str, Request] = {}
        self.leader_of: dict[str, Request] = {}
        self.result = Result()

    # -- requests --------------------------------------------------------------------------------
    def add(self, spec: Spec) -> list[Request]:
        leader = make_req(spec.rid, spec.prompt, spec.max_tokens, spec.arrival, spec.priority)
        sibs = [make_req(f"{spec.rid}#{k}", spec.prompt, spec.max_tokens, spec.arrival, spec.priority)
                for k in range(1, spec.num_siblings + 1)]
        self.sched.add_request(leader, sibs)
        for r in [leader, *sibs]:
            self.all[r.request_id] = r
        for s in sibs:
            self.leader_of[s.request_id] = leader
        return [leader, *sibs]

    def live(self) -> list[Request]:
        return list(self.sched.requests.values())

    def abort(self, req: Request) -> None:
        self.sched.finish_requests([req], RequestStatus.FINISHED_ABORTED)
        self.result.aborted.add(req.request_id)
        assert req.block_ids == []
        assert req.request_id not in self.sched.requests

    # -- invariants ------------------------------------------------------------------------------
    def check_pool(self) -> None:
        refs: Counter[int] = Counter()
        for r in self.live():
            assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id} lists a block twice"
            refs.update(r.block_ids)
            assert len(r.block_ids) * self.bs >= r.num_computed_tokens, f"{r.request_id} blocks don't cover it"
            assert r.num_computed_tokens <= r.num_tokens
        for b in range(self.num_blocks):
            assert self.pool.ref_cnt[b] == refs[b], f"block {b}: ref_cnt {self.pool.ref_cnt[b]} != owners {refs[b]}"
        free = set(self.pool._free)
        assert all(self.pool.ref_cnt[b] == 0 for b in free), "a referenced block sits in the free list"
        assert len(free) == sum(1 for b in range(self.num_blocks) if self.pool.ref_cnt[b] == 0)
        assert self.pool.num_free_blocks == len(free)
        for h, b in self.pool._cached.items():
            assert self.pool._block_hash[b] == h
        for r in self.sched.running:
            assert r.status is RequestStatus.RUNNING
        assert len(self.sched.running) == len(set(map(id, self.sched.running)))
        waiting = list(self.sched.waiting)
        assert not set(map(id, waiting)) & set(map(id, self.sched.running)), "a request both waiting and running"

    def check_published(self) -> None:
        """Every full computed block of a running request is published under its hash, which lets the
        scheduler skip publishing after a token that fills no block."""
        if not self.kv.enable_prefix_caching:
            return
        for r in self.sched.running:
            full = min(r.num_computed_tokens // self.bs, len(r.block_ids))
            assert self.kv._num_published.get(r.request_id, 0) == full, f"{r.request_id} left blocks unpublished"

    def check_reads(self, req: Request, upto: int) -> None:
        """The request's computed positions read back the values its own history implies."""
        for p in range(upto):
            b = req.block_ids[p // self.bs]
            assert self.slots[b][p % self.bs] == kv_value(req.all_token_ids, p), (
                f"{req.request_id} reads a wrong KV entry at position {p} (block {b})")

    # -- one engine step -------------------------------------------------------------------------
    def step(self) -> bool:
        sched, cfg = self.sched, self.config
        before = {id(r): r.num_computed_tokens for r in self.live()}
        waiting_before = {id(r) for r in sched.waiting}
        out = sched.schedule()
        self.result.steps += 1
        # the requests scheduled from the queue, in their order in the step
        assert out.admitted == [r for r in out.requests if id(r) in waiting_before]
        self.check_published()
        assert len(out.requests) == len(out.num_new_tokens)
        assert out.total_num_tokens <= cfg.max_num_batched_tokens
        assert len(out.requests) <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        assert len(set(map(id, out.requests))) == len(out.requests)
        assert all(r in sched.running for r in out.requests)
        assert not set(map(id, out.preempted)) & set(map(id, out.requests))
        for r in out.preempted:
            assert r.block_ids == [] and r.num_computed_tokens == 0
        self.check_pool()

        tokens: list[int] = []
        for r, n in zip(out.requests, out.num_new_tokens):
            assert n >= 1
            assert r.num_computed_tokens + n <= r.num_tokens
            assert len(r.block_ids) * self.bs >= r.num_computed_tokens + n
            if r.request_id not in self.result.first_scheduled:
                self.result.first_scheduled.append(r.request_id)
                if r.request_id in self.leader_of:
                    # a sibling starts only once its leader computed the whole prompt
                    leader = self.leader_of[r.request_id]
                    assert leader.num_computed_tokens >= leader.num_prompt_tokens or leader.status.finished \
                        or leader.request_id in self.result.aborted or leader.num_preemptions > 0
            if not self.chunked:
                # no chunking: a (re)start computes everything it owes at once
                assert r.num_computed_tokens + n == r.num_tokens, f"{r.request_id} was chunked"
            self.check_reads(r, r.num_computed_tokens)
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                b = r.block_ids[p // self.bs]
                assert self.pool.ref_cnt[b] == 1, f"{r.request_id} writes into shared block {b}"
                assert self.pool._block_hash[b] is None, f"{r.request_id} writes into cached block {b}"
                self.slots[b][p % self.bs] = kv_value(r.all_token_ids, p)
            if r.num_computed_tokens + n == r.num_tokens:
                tokens.append(fake_token(r.all_token_ids))

        sampled = sched.update_from_output(out, tokens)
        assert len(sampled) == len(tokens)
        self.check_pool()
        self.check_published()
        done = [r for r in sampled if r.num_output_tokens >= r.max_tokens]
        for r in sampled:
            assert r.num_output_tokens <= r.max_tokens
            # the scheduler ends a request at max_tokens itself, freeing its blocks
            assert (r.status is RequestStatus.FINISHED_LENGTH) == (r in done)
        for r in done:
            self.result.outputs[r.request_id] = list(r.output_token_ids)
            assert r.block_ids == [] and r.request_id not in sched.requests
        self.check_pool()
        after = {id(r): r.num_computed_tokens for r in self.live()}
        return bool(out.requests) or bool(out.preempted) or bool(done) or before != after

    def run(self, specs: list[Spec], aborts: dict[int, list[int]] | None = None, max_steps: int = 5000) -> Result:
        """Add every request up front (in arrival order), then step; `aborts[step]` lists indices into the
        live requests to abort before that step."""
        aborts = aborts or {}
        for s in sorted(specs, key=lambda s: s.arrival):
            self.add(s)
        self.check_pool()
        idle = 0
        for step in range(max_steps):
            for k in aborts.get(step, []):
                live = sorted(self.live(), key=lambda r: r.request_id)
                if live:
                    self.abort(live[k % len(live)])
                    self.check_pool()
            if not self.sched.has_unfinished_requests():
                break
            idle = 0 if self.step() else idle + 1
            assert idle < 3, (f"scheduler stalled at step {step}: running={len(self.sched.running)} "
                              f"waiting={self.sched.num_waiting} free={self.pool.num_free_blocks}")
        else:
            pytest.fail(f"not done after {max_steps} steps")
        self.check_final()
        self.result.num_preemptions = self.sched.num_preemptions
        return self.result

    def check_final(self) -> None:
        sched = self.sched
        assert not sched.has_unfinished_requests()
        assert sched.running == []
        assert len(sched.waiting) == 0
        assert sched.num_waiting == 0
        assert self.pool.num_free_blocks == self.num_blocks
        assert all(c == 0 for c in self.pool.ref_cnt)
        for rid, r in self.all.items():
            assert r.status.finished
            if rid in self.result.aborted:
                assert r.status is RequestStatus.FINISHED_ABORTED
            else:
                assert r.status is RequestStatus.FINISHED_LENGTH
                assert r.num_output_tokens == r.max_tokens
        assert set(self.result.outputs) | self.result.aborted == set(self.all)


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(fake_token(toks))
    return toks[len(prompt):]
