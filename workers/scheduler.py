"""One scheduling loop with one token budget per step: running requests first, then waiting ones.

There are no prefill and decode phases: a request owes `num_tokens - num_computed_tokens` tokens and gets
as many as the budget allows (a decode owes one). When the KV pool runs dry, the running request the
policy ranks lowest is preempted by recompute.

The scheduler, through its `KVCacheManager`, is the only owner of KV blocks: it allocates, shares, frees,
holds (a prefill replica keeps a finished prompt's blocks until `release_held`) and places imported KV
(`add_request(..., num_imported_tokens=...)`). It also ends requests on token-level stops (EOS, stop token
ids, `max_tokens`, `max_model_len`) as it applies each step's sampled tokens.

With `num_speculative_tokens`, a greedy request in decode may also compute draft tokens (`workers/ngram.py`)
in its step: it owes its last token plus the drafts, samples at each of them, and keeps the drafts the model
agrees with plus the model's next token; the KV written for rejected drafts lies past its computed tokens and
is overwritten later."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.kv_cache_manager import KVCacheManager
from workers.ngram import TokenArray, propose
from workers.request import Request, RequestStatus
from workers.request_queue import RequestQueue
from workers.step_costs import StepCosts

# Speculation beside other requests (`Scheduler._earned`): a draft is made when the chance that it is kept,
# by the request's record, is at least what its row costs: the rows' share of a step's time by the engine's
# own steps (`StepCosts.row_share`), within SPEC_MIN_KEEP_ODDS..SPEC_MAX_KEEP_ODDS, or SPEC_KEEP_ODDS until
# the steps tell; a new record reads as SPEC_PRIOR_ODDS with the weight of SPEC_PRIOR_KEPT kept drafts; each
# drafting step first decays the record by SPEC_RECORD_DECAY; a request that earns no draft makes one every
# SPEC_PROBE_EVERY steps.
SPEC_KEEP_ODDS = 0.5
SPEC_MIN_KEEP_ODDS = 0.25
SPEC_MAX_KEEP_ODDS = 0.95
SPEC_PRIOR_ODDS = 0.75
SPEC_PRIOR_KEPT = 1.0
SPEC_RECORD_DECAY = 0.75
SPEC_PROBE_EVERY = 8


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's share of the engine's options (defined, with defaults and help, in `EngineConfig`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    speculative_disable_by_batch_size: int | None = None  # None: no limit


@dataclass(slots=True)
class SchedulerOutput:
    """The step's work, in batch order. A request samples when its chunk reaches its last token."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # scheduled this step from the waiting queue

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def decodes_only(self) -> bool:
        """Whether every request computes one token of its own and its drafts, if any (no prompt chunk of more
        than one token): a step of decode rows only."""
        return all(n == 1 + len(r.spec_token_ids) for r, n in zip(self.requests, self.num_new_tokens))

    def sample_rows(self) -> list[int]:
        """The indices of the scheduled requests that sample a token this step: those whose chunk reaches
        their last token (past it are only their drafts, if any)."""
        return [i for i, (r, n) in enumerate(zip(self.requests, self.num_new_tokens))
                if r.num_computed_tokens + n >= len(r.all_token_ids)]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, waiting: RequestQueue) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = waiting
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Siblings of an n>1 request wait here until their leader has computed the shared prompt.
        self.pending_forks: dict[str, list[Request]] = {}
        # Finished `hold_kv` requests whose blocks wait for `release_held` (their KV is being transferred).
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_import_fallbacks = 0  # imported KV that found no free blocks: the prompt is recomputed
        # Speculation: steps in which a request computed drafts, the drafts computed, those the model agreed
        # with, and of those how many at each draft position (index 0: the first draft).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        # what a row of a decode step costs, from the engine's steps (it observes them): the odds a draft beside
        # other requests needs (`keep_odds`)
        self.step_costs = StepCosts() if config.num_speculative_tokens else None
        self._keep_odds = SPEC_KEEP_ODDS

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(v) for v in self.pending_forks.values())

    @property
    def num_pending_tokens(self) -> int:
        """Prompt (or recompute) tokens not yet computed: the prefill backlog."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.requests.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request, siblings: list[Request] | None = None,
                    num_imported_tokens: int = 0) -> bool:
        """Queue a request; `siblings` share its prompt and start once the leader has computed it.

        `num_imported_tokens`: the first tokens' KV was computed elsewhere; their blocks are allocated
        now and counted as computed, and the caller writes the KV into `request.block_ids` before the next
        `schedule()`. Returns False if the pool has no room for them (the prompt is then computed here)."""
        imported = num_imported_tokens > 0 and self.kv_cache.allocate_slots(request, num_imported_tokens)
        if num_imported_tokens > 0 and not imported:
            self.num_import_fallbacks += 1
        if imported:
            request.num_computed_tokens = num_imported_tokens
            self.kv_cache.cache_computed_blocks(request)
        for req in [request, *(siblings or ())]:
            p = req.sampling_params
            req.stop_ids = frozenset(p.stop_token_ids) | (
                frozenset() if p.ignore_eos or req.eos_token_id is None else {req.eos_token_id})
            req.stop_at = min(len(req.prompt_token_ids) + req.max_tokens, self.config.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if siblings:
            for sib in siblings:
                self.requests[sib.request_id] = sib
            self.pending_forks[request.request_id] = list(siblings)
        return imported

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}

        speculate = self.speculates()
        if speculate and len(self.running) > 1:
            self._keep_odds = self.keep_odds()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.spec_token_ids:
                req.spec_token_ids = []  # left by a step that never applied (it raised)
            num_new = min(len(req.all_token_ids) - req.num_computed_tokens, budget)
            if speculate and num_new == 1 and self._may_speculate(req):
                drafts = self._drafts(req, budget - 1)
                if drafts and self.kv_cache.allocate_slots(req, 1 + len(drafts)):
                    req.spec_token_ids = drafts
                    scheduled[req] = 1 + len(drafts)
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
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
            out.admitted = self._admit_waiting(scheduled, budget)

        for req in self.running:
            n = scheduled.get(req)
            if n:
                out.requests.append(req)
                out.num_new_tokens.append(n)
        return out

    def speculates(self) -> bool:
        """Whether `schedule` may give requests drafts now: speculation on, and no more requests running than
        `speculative_disable_by_batch_size`."""
        limit = self.config.speculative_disable_by_batch_size
        return self.config.num_speculative_tokens > 0 and (limit is None or len(self.running) <= limit)

    def keep_odds(self) -> float:
        """The chance of being kept that a draft needs beside the requests running now: the share of a step's
        time that its rows cost (`StepCosts.row_share`: a row more pays when its draft is kept with at least
        that chance), within SPEC_MIN_KEEP_ODDS..SPEC_MAX_KEEP_ODDS; SPEC_KEEP_ODDS until the engine's steps
        have told it."""
        share = None if self.step_costs is None else self.step_costs.row_share(len(self.running))
        return SPEC_KEEP_ODDS if share is None else min(SPEC_MAX_KEEP_ODDS, max(SPEC_MIN_KEEP_ODDS, share))

    def may_run_ahead(self) -> bool:
        """Whether steps may be scheduled ahead (`schedule_ahead`): no request waits to be admitted, and
        `schedule` would give none drafts (`speculates`), so a step ahead is the step it would schedule."""
        return not len(self.waiting) and not self.pending_forks and not self.speculates()

    def schedule_ahead(self, current: SchedulerOutput) -> tuple[SchedulerOutput, list[int]] | None:
        """The decode step after `current`, a decode-only step still on the device whose tokens are not known
        (async scheduling): its requests that go on (not finished since, and with room for a token after the
        one in flight, which may be their last by `max_tokens`, within `max_model_len`), each with a slot for
        that token, and their rows in `current`. None while a request waits to be admitted, or when the pool
        is short of a slot: then `schedule` decides in turn (and preempts)."""
        if not self.may_run_ahead():
            return None
        reqs: list[Request] = []
        rows: list[int] = []
        add_req, add_row, allocate = reqs.append, rows.append, self.kv_cache.allocate_slots
        bs = self.kv_cache.block_size
        for i, r in enumerate(current.requests):  # at batch 256, every decode step: kept lean
            if r.status.finished or len(r.all_token_ids) + 1 - len(r.prompt_token_ids) >= r.max_tokens:
                continue
            if r.num_computed_tokens + 2 > len(r.block_ids) * bs and not allocate(r, 2):
                return None
            add_req(r)
            add_row(i)
        return (SchedulerOutput(reqs, [1] * len(reqs)), rows) if reqs else None

    @staticmethod
    def _may_speculate(req: Request) -> bool:
        """Greedy requests whose every next token depends only on the logits: no logprobs, penalties, bias,
        bans, grammar or stop strings (those are decided token by token), past `min_tokens`, and not a prefill
        replica's. All but `min_tokens` is fixed for a request's life: decided once (`Request.may_draft`)."""
        p = req.sampling_params
        fixed = req.may_draft
        if fixed is None:
            fixed = req.may_draft = bool(
                p.greedy and p.logprobs is None and p.prompt_logprobs is None and not p.adjusts_logits
                and not p.stop_strings and p.structured_outputs is None and not req.bad_words_token_ids
                and not req.hold_kv)
        return fixed and (not p.min_tokens or req.num_output_tokens >= p.min_tokens)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for `req`, no more than it may still generate (its last token's successor is the
        model's own) nor than `budget`, nor, beside other requests, than its record earns (`_earned`)."""
        c = self.config
        room = min(c.num_speculative_tokens, budget, req.max_tokens - req.num_output_tokens - 1,
                   c.max_model_len - req.num_tokens - 1)
        if room > 0 and len(self.running) > 1:
            room = self._earned(req, room, self._keep_odds)
        if room <= 0:
            return []
        if req.token_array is None:
            req.token_array = TokenArray()
        return propose(req.token_array.of(req.all_token_ids), room, c.prompt_lookup_max, c.prompt_lookup_min)

    @staticmethod
    def _earned(req: Request, room: int, keep_odds: float) -> int:
        """How many drafts a request's record earns: the most whose last is kept with a chance of at least
        `keep_odds` (`keep_odds()`), each draft kept with the chance its record gives (kept / judged, starting
        from 0.75). Alone, a request's drafts are nearly free rows beside the weights every step reads, so it
        drafts in full. Beside others a row may cost about what a kept draft saves: on a 2-core Xeon a burst of
        256 requests took 2.3 times as long when every draft was refused, and its steps of 129-256 requests
        made tokens no faster than without drafts when 70% were kept. A request that earns none drafts one
        every SPEC_PROBE_EVERY steps, to learn again."""
        odds = (req.spec_kept + SPEC_PRIOR_KEPT) / (req.spec_judged + SPEC_PRIOR_KEPT / SPEC_PRIOR_ODDS)
        n, chance = 0, 1.0
        while n < room and chance * odds >= keep_odds:
            chance *= odds
            n += 1
        if n == 0:
            req.spec_skipped += 1
            if req.spec_skipped >= SPEC_PROBE_EVERY:
                n = 1
        if n:
            req.spec_skipped = 0
        return n

    def _admit_waiting(self, scheduled: dict[Request, int], budget: int) -> list[Request]:
        """Schedule waiting requests in the policy's order while the budget, the batch and the pool allow;
        returns them."""
        bs = self.kv_cache.block_size
        admitted = []
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
            admitted.append(req)
            scheduled[req] = num_new
            budget -= num_new
        return admitted

    def _sibling_blocks(self, req: Request) -> list[int]:
        """Blocks of the live leader whose prompt this sibling shares; taken only on admission, so a
        waiting sibling never pins blocks."""
        src = req.fork_source
        if src is None or src.status is not RequestStatus.RUNNING:
            return []
        return self.kv_cache.shareable_prefix(req, src)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        self.kv_cache.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._release_siblings(req, share=False)
        self.waiting.prepend(req)

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: list[int],
                           accepted: dict[str, int] | None = None) -> list[Request]:
        """Advance each scheduled request by its chunk; those that reached their end take a new token (after
        as many of their drafts as `accepted` says, if they had any), and those whose token stops them are finished (`status`
        tells). Returns the requests that sampled, in batch order."""
        sampled: list[Request] = []
        tokens = iter(sampled_token_ids)
        bs = self.kv_cache.block_size
        add, check_stop, forks = sampled.append, self.check_stop, self.pending_forks  # a lean loop (256 a step)
        for req, n in zip(out.requests, out.num_new_tokens):
            if req.spec_token_ids:
                self._apply_drafts(req, (accepted or {}).get(req.request_id, 0), next(tokens))
                add(req)
                continue
            computed = req.num_computed_tokens = req.num_computed_tokens + n
            if n > 1 or computed % bs == 0:  # else no block filled: nothing to publish
                self.kv_cache.cache_computed_blocks(req)
            ids = req.all_token_ids
            if computed == len(ids):
                if forks and req.request_id in forks:
                    self._release_siblings(req, share=True)
                token = next(tokens)
                ids.append(token)
                add(req)
                if token in req.stop_ids or len(ids) >= req.stop_at:  # else nothing stops it (`Request.stop_at`)
                    status = check_stop(req)
                    if status is not None:
                        self.finish_requests([req], status)
        return sampled

    def _apply_drafts(self, req: Request, accepted: int, token: int) -> None:
        """A speculating request computed its last token and its drafts: the first `accepted` drafts now
        count as computed, and its new tokens are those drafts and then `token`, up to a stop."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        req.spec_kept = SPEC_RECORD_DECAY * req.spec_kept + accepted
        req.spec_judged = SPEC_RECORD_DECAY * req.spec_judged + accepted + (accepted < len(drafts))
        if len(self.accepted_per_pos) < len(drafts):
            self.accepted_per_pos += [0] * (len(drafts) - len(self.accepted_per_pos))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1
        computed = req.num_computed_tokens + 1 + accepted
        status = None
        for t in drafts[:accepted] + [token]:
            req.append_token(t)
            status = self.check_stop(req)
            if status is not None:
                break
        req.num_computed_tokens = min(computed, req.num_tokens - 1)
        self.kv_cache.cache_computed_blocks(req)
        if status is not None:
            self.finish_requests([req], status)

    def check_stop(self, req: Request) -> RequestStatus | None:
        """The finished status the request's newest token gives it, if any. Stops (EOS, stop token ids)
        count once `min_tokens` are out (the sampler masks them before) or at `max_tokens`."""
        p = req.sampling_params
        ids = req.all_token_ids
        n_out, token = len(ids) - len(req.prompt_token_ids), ids[-1]
        if n_out > p.min_tokens or n_out == req.max_tokens:
            if token == req.eos_token_id and not p.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or len(ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _release_siblings(self, leader: Request, share: bool) -> None:
        for sib in self.pending_forks.pop(leader.request_id, []):
            sib.fork_source = leader if share else None
            self.waiting.add(sib)

    def finish_requests(self, requests: list[Request], status: RequestStatus) -> None:
        """End requests (running, waiting or pending) and forget them; already finished ones are skipped.
        Their blocks go back to the pool, except a `hold_kv` request that did not abort: its blocks stay
        in `held` until `release_held`."""
        requests = [r for r in requests if not r.status.finished]
        if not requests:
            return
        done = set(requests)
        self.running = [r for r in self.running if r not in done]
        for req in requests:
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and req in self.waiting:
                self.waiting.remove(req)
            for sibs in self.pending_forks.values():
                if req in sibs:
                    sibs.remove(req)
            self._release_siblings(req, share=False)
            req.status = status
            self.requests.pop(req.request_id, None)
            if req.hold_kv and status is not RequestStatus.FINISHED_ABORTED:
                self.held[req.request_id] = req
            else:
                self.kv_cache.free(req)
            if status is not RequestStatus.FINISHED_ABORTED:
                self.waiting.on_finished(req)

    def release_held(self, request_id: str) -> bool:
        """Free the blocks of a held request (its transfer is confirmed or its lease expired). False if
        unknown."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv_cache.free(req)
        return True
