"""Scheduler driven by a fake engine loop, with invariants checked after every step.

The fake model keeps a simulated KV cache: every computed position writes a value that depends on the
whole token history up to it into its block slot, and every step first checks that the request's already
computed positions read back what they should. So a prefix-cache hit, a shared sibling block or a block
reused too early shows up as a wrong read, not only as a wrong ref count."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_harness import POLICIES, Harness, Spec, expected_output, fake_token, make_req
from workers.kv_cache_manager import KVCacheManager, cdiv
from workers.request import Request, RequestStatus
from workers.request_queue import make_request_queue
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig


# ---- strategies ------------------------------------------------------------------------------------


@st.composite
def scenarios(draw, *, siblings: bool = False, with_aborts: bool = True):
    block_size = draw(st.sampled_from([1, 2, 4]))
    prefixes = [draw(st.lists(st.integers(0, 3), min_size=1, max_size=12)) for _ in range(2)]
    n = draw(st.integers(1, 7))
    specs = []
    for i in range(n):
        shared = draw(st.sampled_from([[], prefixes[0], prefixes[0], prefixes[1]]))
        tail = draw(st.lists(st.integers(0, 3), min_size=0 if shared else 1, max_size=10))
        prompt = (shared + tail) or [0]
        specs.append(Spec(f"r{i}", prompt, draw(st.integers(1, 8)), float(draw(st.integers(0, 20))) + i / 100,
                          draw(st.integers(0, 2)), draw(st.integers(0, 2)) if siblings else 0))
    longest = max(len(s.prompt) + s.max_tokens for s in specs)
    min_blocks = cdiv(longest, block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks * 2))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 2 * longest)) if chunked else draw(st.integers(longest, 2 * longest))
    cfg = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=draw(st.integers(1, 6)),
               max_num_batched_tokens=budget, chunked=chunked, prefix_caching=draw(st.booleans()),
               policy=draw(st.sampled_from(POLICIES)))
    aborts = {}
    if with_aborts:
        for _ in range(draw(st.integers(0, 3))):
            aborts.setdefault(draw(st.integers(0, 15)), []).append(draw(st.integers(0, 50)))
    return cfg, specs, aborts


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- property tests ------------------------------------------------------------------------------


@SETTINGS
@given(scenarios())
def test_random_workloads_keep_invariants_and_finish(scenario):
    cfg, specs, aborts = scenario
    res = Harness(**cfg).run(specs, aborts)
    for s in specs:
        if s.rid not in res.aborted:
            assert res.outputs[s.rid] == expected_output(s.prompt, s.max_tokens)


@SETTINGS
@given(scenarios(with_aborts=False))
def test_small_pool_gives_same_outputs_as_huge_pool(scenario):
    cfg, specs, _ = scenario
    small = Harness(**cfg).run(specs)
    huge_cfg = dict(cfg, num_blocks=cfg["num_blocks"] * 10, max_num_seqs=64, max_num_batched_tokens=10_000)
    huge = Harness(**huge_cfg).run(specs)
    assert huge.num_preemptions == 0
    assert small.outputs == huge.outputs
    assert set(small.outputs) == {s.rid for s in specs}


@SETTINGS
@given(scenarios(with_aborts=False), st.booleans())
def test_fcfs_without_preemption_schedules_in_arrival_order(scenario, chunked):
    cfg, specs, _ = scenario
    longest = max(len(s.prompt) + s.max_tokens for s in specs)
    total_blocks = sum(cdiv(len(s.prompt) + s.max_tokens, cfg["block_size"]) for s in specs)
    cfg = dict(cfg, policy="fcfs", num_blocks=total_blocks, chunked=chunked,
               max_num_batched_tokens=max(cfg["max_num_batched_tokens"], longest if not chunked else 1))
    res = Harness(**cfg).run(specs)
    assert res.num_preemptions == 0
    order = [s.rid for s in sorted(specs, key=lambda s: s.arrival)]
    assert res.first_scheduled == order


@SETTINGS
@given(scenarios(siblings=True))
def test_random_workloads_with_siblings(scenario):
    cfg, specs, aborts = scenario
    res = Harness(**cfg).run(specs, aborts)
    for s in specs:
        for rid in [s.rid] + [f"{s.rid}#{k}" for k in range(1, s.num_siblings + 1)]:
            if rid not in res.aborted:
                assert res.outputs[rid] == expected_output(s.prompt, s.max_tokens)


# ---- targeted tests ------------------------------------------------------------------------------


def test_budget_and_max_num_seqs_are_respected_with_chunking():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=2, max_num_batched_tokens=10)
    specs = [Spec(f"r{i}", list(range(i, i + 13)), 3, float(i)) for i in range(4)]
    for s in specs:
        h.add(s)
    out = h.sched.schedule()
    assert [r.request_id for r in out.requests] == ["r0"]
    assert out.num_new_tokens == [10]  # r0's prompt is chunked at the budget
    h.sched.update_from_output(out, [])
    out = h.sched.schedule()
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert out.num_new_tokens == [3, 7]
    assert len(h.sched.running) == 2 and len(h.sched.waiting) == 2


def test_no_chunking_waits_for_budget_instead_of_splitting():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=8, max_num_batched_tokens=20, chunked=False)
    h.add(Spec("a", list(range(12)), 4, 0.0))
    h.add(Spec("b", list(range(50, 62)), 4, 1.0))
    out = h.sched.schedule()
    assert [r.request_id for r in out.requests] == ["a"]
    assert out.num_new_tokens == [12]


def test_prefix_cache_hit_in_the_scheduler():
    h = Harness(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    prompt = list(range(10))
    h.run([Spec("a", prompt, 2, 0.0)])
    h.add(Spec("b", prompt + [7], 2, 1.0))
    out = h.sched.schedule()
    (b,) = out.requests
    assert out.num_new_tokens == [11 - 8]  # two full blocks came from the cache
    assert b.num_cached_tokens == 8
    assert h.kv.prefix_cache_hits == 8


def test_preemption_happens_and_recompute_reproduces_outputs():
    # each request needs 4 blocks over its life; 6 blocks can't hold three of them
    specs = [Spec(f"r{i}", [i] * 6 + [9, 9], 8, float(i)) for i in range(3)]
    for policy in POLICIES:
        for caching in (True, False):
            small = Harness(num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                            policy=policy, prefix_caching=caching)
            res = small.run(specs)
            assert res.num_preemptions > 0, policy
            huge = Harness(num_blocks=600, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                           policy=policy, prefix_caching=caching).run(specs)
            assert huge.num_preemptions == 0
            assert res.outputs == huge.outputs == {s.rid: expected_output(s.prompt, 8) for s in specs}


def test_fcfs_preempts_the_newest_and_requeues_it_first():
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefix_caching=False)
    a, = h.add(Spec("a", list(range(4)), 8, 0.0))
    b, = h.add(Spec("b", list(range(10, 14)), 8, 1.0))
    c, = h.add(Spec("c", list(range(20, 24)), 8, 2.0))
    d, = h.add(Spec("d", list(range(30, 34)), 8, 3.0))
    h.step()
    assert h.sched.running == [a, b, c, d]
    out = h.sched.schedule()  # each needs a 2nd block: d and c make room for a and b
    assert out.preempted == [d, c]
    assert [r.request_id for r in h.sched.waiting] == ["c", "d"]
    assert out.requests == [a, b]


def test_preempting_an_already_scheduled_victim_refunds_its_budget():
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=6, policy="priority",
                prefix_caching=False)
    low, = h.add(Spec("low", [1, 2, 3, 4], 10, 0.0, priority=5))
    h.step()
    hi, = h.add(Spec("hi", [5, 6, 7, 8], 10, 1.0))
    big, = h.add(Spec("big", list(range(100, 140)), 10, 2.0))
    h.step()
    assert h.sched.running == [low, hi, big]
    out = h.sched.schedule()  # hi needs a 2nd block: low (scheduled first, ranked last) is preempted
    assert out.preempted == [low]
    assert out.requests == [hi, big]
    assert out.num_new_tokens == [1, 5]  # low's token went back into the budget, and big got it


def test_sibling_starts_after_leader_prompt_and_shares_its_blocks():
    h = Harness(num_blocks=50, block_size=4, max_num_seqs=8, max_num_batched_tokens=6)
    prompt = list(range(10))  # 2 full blocks + 2
    leader, sib = h.add(Spec("a", prompt, 3, 0.0, num_siblings=1))
    assert h.sched.num_waiting == 2
    h.step()  # leader computes 6 of 10
    assert h.result.first_scheduled == ["a"]
    assert sib.block_ids == [] and sib.status is RequestStatus.WAITING
    assert len(h.sched.waiting) == 0 and h.sched.num_waiting == 1  # the sibling is pending, not queued
    h.step()  # leader finishes its prompt and samples; the sibling is queued, pinning nothing yet
    assert leader.num_output_tokens == 1
    assert sib.block_ids == [] and sib.fork_source is leader
    out = h.sched.schedule()  # admission takes the leader's two full blocks by reference
    assert out.requests == [leader, sib]
    assert out.num_new_tokens == [1, 2]  # the sibling only computes the rest of its prompt
    assert sib.num_computed_tokens == 8
    assert [h.pool.ref_cnt[b] for b in leader.block_ids] == [2, 2, 1]
    assert sib.block_ids[:2] == leader.block_ids[:2] and len(sib.block_ids) == 3
    assert sib.block_ids[2] != leader.block_ids[2]
    h.sched.update_from_output(out, [fake_token(leader.all_token_ids), fake_token(sib.all_token_ids)])
    assert sib.output_token_ids == expected_output(prompt, 3)[:1]


def test_sibling_without_prefix_caching_still_shares():
    h = Harness(num_blocks=50, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefix_caching=False)
    leader, sib = h.add(Spec("a", list(range(9)), 3, 0.0, num_siblings=1))
    h.step()
    h.step()
    assert sib.block_ids[:2] == leader.block_ids[:2]
    assert [h.pool.ref_cnt[b] for b in sib.block_ids[:2]] == [2, 2]
    res = h.run([])
    assert res.outputs["a"] == res.outputs["a#1"] == expected_output(list(range(9)), 3)


def test_aborting_leader_before_prompt_releases_siblings_unshared():
    h = Harness(num_blocks=50, block_size=4, max_num_seqs=8, max_num_batched_tokens=4)
    leader, s1, s2 = h.add(Spec("a", list(range(10)), 3, 0.0, num_siblings=2))
    h.step()
    h.abort(leader)
    assert s1.block_ids == [] and s2.block_ids == []
    assert h.sched.num_waiting == 2 and "a" not in h.sched.pending_forks
    h.check_pool()
    res = h.run([])
    assert res.outputs["a#1"] == res.outputs["a#2"] == expected_output(list(range(10)), 3)


def test_waiting_sibling_pins_no_blocks_and_can_be_aborted():
    h = Harness(num_blocks=50, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    leader, sib = h.add(Spec("a", list(range(9)), 3, 0.0, num_siblings=1))
    h.step()  # max_num_seqs=1 keeps the sibling waiting; it takes shared blocks only when admitted
    assert sib.block_ids == [] and sib.fork_source is leader
    assert all(h.pool.ref_cnt[b] == 1 for b in leader.block_ids)
    h.abort(sib)
    assert all(h.pool.ref_cnt[b] == 1 for b in leader.block_ids)
    h.check_pool()
    h.run([])


def test_aborting_a_pending_sibling():
    h = Harness(num_blocks=50, block_size=4, max_num_seqs=8, max_num_batched_tokens=2)
    leader, sib = h.add(Spec("a", list(range(9)), 3, 0.0, num_siblings=1))
    h.step()
    h.abort(sib)  # still pending behind its leader
    assert h.sched.num_waiting == 0
    res = h.run([])
    assert res.outputs == {"a": expected_output(list(range(9)), 3)}


def test_sibling_pinned_blocks_do_not_deadlock_a_minimal_pool_no_caching():
    """The engine only checks num_blocks * block_size >= max_model_len, and n > 1 is allowed. A waiting
    sibling that pinned its leader's prompt blocks would leave a preempted leader unable to fit again
    behind FCFS head-of-line blocking: nothing running, a stall. Siblings take blocks only on admission."""
    # b: 4 + 8 tokens (3 blocks at most), a: 8 + 8 tokens (4 blocks at most), a's sibling shares 1 block
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefix_caching=False)
    res = h.run([Spec("b", [1, 2, 3, 4], 8, 0.0), Spec("a", list(range(10, 18)), 8, 1.0, num_siblings=1)],
                max_steps=300)
    assert set(res.outputs) == {"a", "a#1", "b"}


def test_sibling_pinned_blocks_do_not_deadlock_a_minimal_pool_with_caching():
    """The same stall with prefix caching on: were b's waiting sibling to pin one block of a 3-block
    pool, a's sibling (6 + 6 tokens, 3 blocks at most) could never get 3 blocks back after preempting
    itself."""
    h = Harness(num_blocks=3, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, prefix_caching=True)
    res = h.run([Spec("a", list(range(6)), 6, 0.0, num_siblings=1),
                 Spec("b", [50, 51, 52, 53, 54], 1, 1.0, num_siblings=1)], max_steps=300)
    assert set(res.outputs) == {"a", "a#1", "b", "b#1"}


def test_predicted_policy_predicts_cost_for_siblings():
    """Siblings get a predicted cost like every other request; with 0.0 they would jump ahead of
    everyone and never be the preferred preemption victim."""
    class Fixed:
        def predict(self, request):
            return 50.0

        def observe(self, request):
            pass

    kv = KVCacheManager(50, 4)
    sched = Scheduler(SchedulerConfig(8, 64, True, 1024), kv, make_request_queue("predicted", Fixed()))
    leader = make_req("a", list(range(9)), 3, 0.0)
    sib = make_req("a#1", list(range(9)), 3, 0.0)
    sched.add_request(leader, [sib])
    out = sched.schedule()
    sched.update_from_output(out, [1])
    assert sib.fork_source is leader  # queued to share the leader's blocks
    assert leader.predicted_cost == 50.0
    assert sib.predicted_cost == 50.0


# ---- block ownership: token-level stops, held KV, imported KV ----------------------------------------


def _sched(num_blocks: int = 20, block_size: int = 4, max_model_len: int = 64, policy: str = "fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, True, max_model_len), KVCacheManager(num_blocks, block_size),
                     make_request_queue(policy))


def _run_prompt(sched: Scheduler, req, token: int):
    out = sched.schedule()
    assert req in out.requests
    return sched.update_from_output(out, [token])


def test_token_level_stops_finish_and_free_inside_the_scheduler():
    sched = _sched()
    free = sched.kv_cache.pool.num_free_blocks
    eos = Request("eos", [1, 2, 3], SamplingParams(max_tokens=5), 5, eos_token_id=9)
    sched.add_request(eos)
    assert _run_prompt(sched, eos, 9) == [eos]
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.block_ids == [] and eos.stop_reason is None
    stop_id = Request("sid", [1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=[7]), 5, eos_token_id=9)
    sched.add_request(stop_id)
    _run_prompt(sched, stop_id, 7)
    assert stop_id.status is RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 7
    ignore = Request("ign", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), 2, eos_token_id=9)
    sched.add_request(ignore)
    _run_prompt(sched, ignore, 9)
    assert ignore.status is RequestStatus.RUNNING
    sched.update_from_output(sched.schedule(), [9])
    assert ignore.status is RequestStatus.FINISHED_LENGTH  # max_tokens, EOS ignored
    long = Request("len", list(range(62)), SamplingParams(max_tokens=None), 2, eos_token_id=9)
    sched.add_request(long)
    _run_prompt(sched, long, 1)
    sched.update_from_output(sched.schedule(), [1])
    assert long.status is RequestStatus.FINISHED_LENGTH and long.num_tokens == 64  # max_model_len
    assert sched.kv_cache.pool.num_free_blocks == free and not sched.has_unfinished_requests()


def test_a_step_checks_for_stops_only_the_tokens_that_may_stop_their_request():
    """`Request.stop_ids` and `stop_at` (set by `add_request`): a token that is no stop id, at a length short of
    `max_tokens` and `max_model_len`, skips `check_stop`; the others go through it (and a request the
    scheduler was not given to add, with the defaults, has every token checked)."""
    sched = _sched()
    checked = []
    check = sched.check_stop
    sched.check_stop = lambda req: checked.append(req.num_output_tokens) or check(req)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=5, stop_token_ids=[7]), 5, eos_token_id=9)
    sched.add_request(req)
    assert req.stop_ids == {7, 9} and req.stop_at == 8
    _run_prompt(sched, req, 4)
    for token in (5, 6, 8):
        sched.update_from_output(sched.schedule(), [token])
    assert checked == [] and req.status is RequestStatus.RUNNING
    sched.update_from_output(sched.schedule(), [3])
    assert checked == [5] and req.status is RequestStatus.FINISHED_LENGTH
    ignoring = Request("i", [1, 2], SamplingParams(max_tokens=9, ignore_eos=True), 9, eos_token_id=9)
    sched.add_request(ignoring)
    assert ignoring.stop_ids == frozenset()
    stopping = Request("s", [1, 2], SamplingParams(max_tokens=9), 9, eos_token_id=9)
    sched.add_request(stopping)
    out = sched.schedule()
    sched.update_from_output(out, [9] * len(out.requests))  # EOS for both: one ignores it
    assert checked == [5, 1] and stopping.status is RequestStatus.FINISHED_STOPPED  # only its EOS was checked
    assert ignoring.status is RequestStatus.RUNNING
    unadded = Request("u", [1], SamplingParams(max_tokens=9), 9)
    assert unadded.stop_at == 0  # every token checked


def test_min_tokens_defers_token_stops():
    sched = _sched()
    req = Request("m", [1, 2], SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[7]), 5, eos_token_id=9)
    sched.add_request(req)
    _run_prompt(sched, req, 9)
    sched.update_from_output(sched.schedule(), [7])
    assert req.status is RequestStatus.RUNNING  # 2 tokens out: not yet past min_tokens
    sched.update_from_output(sched.schedule(), [7])
    assert req.status is RequestStatus.FINISHED_STOPPED and req.num_output_tokens == 3


def test_held_blocks_stay_until_released_and_aborts_never_hold():
    sched = _sched()
    free = sched.kv_cache.pool.num_free_blocks
    req = Request("p", list(range(10)), SamplingParams(max_tokens=1), 1, hold_kv=True)
    sched.add_request(req)
    _run_prompt(sched, req, 3)
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert sched.held == {"p": req} and len(req.block_ids) == 3 and req.num_computed_tokens == 10
    assert sched.kv_cache.pool.num_free_blocks == free - 3
    assert sched.release_held("p") and not sched.release_held("p")
    assert req.block_ids == [] and sched.kv_cache.pool.num_free_blocks == free
    aborted = Request("q", list(range(10)), SamplingParams(max_tokens=1), 1, hold_kv=True)
    sched.add_request(aborted)
    sched.schedule()
    sched.finish_requests([aborted], RequestStatus.FINISHED_ABORTED)
    assert sched.held == {} and sched.kv_cache.pool.num_free_blocks == free


def test_imported_kv_is_placed_by_the_scheduler_or_recomputed_when_full():
    sched = _sched(num_blocks=4, block_size=4)
    req = Request("d", list(range(9)), SamplingParams(max_tokens=2), 2)
    assert sched.add_request(req, num_imported_tokens=8)
    assert req.num_computed_tokens == 8 and len(req.block_ids) == 2
    out = sched.schedule()
    assert out.num_new_tokens == [1] and req.num_cached_tokens == 8  # only the last prompt token is computed
    other = Request("e", list(range(20, 29)), SamplingParams(max_tokens=2), 2)
    assert not sched.add_request(other, num_imported_tokens=8)  # 1 block left: falls back to recompute
    assert other.block_ids == [] and other.num_computed_tokens == 0 and sched.num_import_fallbacks == 1


def test_finished_requests_feed_the_policy_hook_but_aborts_do_not():
    seen = []

    class Recorder:
        def predict(self, request):
            return 1.0

        def observe(self, request):
            seen.append(request.request_id)

    sched = Scheduler(SchedulerConfig(8, 64, True, 64), KVCacheManager(20, 4), make_request_queue("predicted", Recorder()))
    done = Request("done", [1, 2], SamplingParams(max_tokens=1), 1)
    gone = Request("gone", [1, 2], SamplingParams(max_tokens=1), 1)
    sched.add_request(done)
    sched.add_request(gone)
    sched.finish_requests([gone], RequestStatus.FINISHED_ABORTED)
    _run_prompt(sched, done, 5)
    assert seen == ["done"]
