"""Async scheduling (`Engine.async_scheduling`, on by default on one GPU): each decode step is queued behind
the one in flight, its input ids read from that step's sampled ids on the device. On the CPU, forced on, every
step runs as it is queued, so what is checked here is the bookkeeping: the same requests give the same outputs
as step by step (stop tokens, stop strings, max_tokens reached at different steps, seeds, logprobs,
min_tokens, penalties (which run ahead too), n > 1, aborts and requests arriving while steps run ahead), a
request a step ends does not count the token computed for it in the step queued behind, and every block goes
back to the pool."""

from __future__ import annotations

import json
import re

import pytest

from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.penalties import bad_words_token_ids
from workers.sampling_params import SamplingParams
from workers.structured_params import StructuredOutputsParams

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 17, list(range(300, 303)), list(range(7, 30))]


def _engine(model: str, **kw) -> Engine:
    engine = Engine(model=model, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB",
                    max_num_batched_tokens=32, num_speculative_tokens=0, **kw)  # chunks, decodes and mixed steps
    assert not engine.async_scheduling  # off on the CPU by default
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    # without prefix caching, so that a run computes the same tokens whichever ran before it
    return _engine(tiny_model_dir, enable_prefix_caching=False)


class _Counting:
    """Counts the steps the runner queued ahead, and those it failed to (the engine would run them in turn)."""

    def __init__(self, runner) -> None:
        self.runner, self.ahead, self.failed, self.last_position = runner, 0, 0, 0
        self.launch_ahead = runner.launch_ahead

    def __call__(self, *args, **kwargs):
        self.last_position = max([self.last_position] + [r.num_computed_tokens + 1 for r in args[0]])
        try:
            pending = self.launch_ahead(*args, **kwargs)
        except Exception:
            self.failed += 1
            raise
        self.ahead += 1
        return pending


def _run(engine: Engine, ahead: bool, requests: list[tuple[list[int], SamplingParams]],
         kind: OutputKind = OutputKind.FINAL_ONLY, between=None) -> dict[str, list]:
    """Every output each request reported, in order, the tokens the steps computed, and how many steps ran
    ahead. `between(engine, step_index)` runs after each step (aborts, new requests)."""
    engine.async_scheduling = ahead
    counting = _Counting(engine.runner)
    engine.runner.launch_ahead = counting
    computed = engine.get_stats().computed_tokens
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"q{i}", None, params, prompt_token_ids=ids, output_kind=kind)
    got: dict[str, list] = {}
    steps = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).append(
                    [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, _rounded(c.logprobs))
                     for c in out.outputs] + [out.finished])
            if between is not None:
                between(engine, steps)
            steps += 1
            assert steps < 500
    finally:
        del engine.runner.launch_ahead
    engine._inflight = None  # left by the last requests' abort, if any
    assert engine._pending is None and engine.kv_cache.usage == 0
    got["computed_tokens"] = engine.get_stats().computed_tokens - computed
    got["ahead"] = counting.ahead
    got["last_position_ahead"] = counting.last_position
    assert counting.failed == 0
    return got


def _rounded(logprobs):
    if logprobs is None:
        return None
    return [{t: (round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in pos.items()} for pos in logprobs]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def _same(plain: dict, ahead: dict) -> None:
    assert ahead["ahead"] > 0, "no step ran ahead"
    assert plain["ahead"] == 0
    mine = ("ahead", "last_position_ahead")
    assert {k: v for k, v in ahead.items() if k not in mine} == {k: v for k, v in plain.items() if k not in mine}


def test_greedy_requests_ending_at_different_steps(engine):
    reqs = [(p, _greedy(n)) for p, n in zip(PROMPTS, [3, 14, 9, 1, 20])]
    plain = _run(engine, False, reqs)
    ahead = _run(engine, True, reqs)
    _same(plain, ahead)
    # nearly every decode step ran ahead: the steps are the longest request's decodes after the prefills
    assert ahead["ahead"] >= 14


def test_requests_reaching_max_model_len_are_not_run_past_it(tiny_model_dir):
    """A request whose token in flight fills max_model_len is left out of the step queued behind: there is no
    position after it (the rotary table ends there)."""
    engine = _engine(tiny_model_dir, enable_prefix_caching=False, max_model_len=48)
    reqs = [(PROMPTS[1], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)),  # 40 + 8: the limit
            (PROMPTS[0], _greedy(30))]
    plain = _run(engine, False, reqs)
    ahead = _run(engine, True, reqs)
    _same(plain, ahead)
    assert len(ahead["q0"][-1][0][2]) == 8 and ahead["q0"][-1][0][3] == "length"
    assert ahead["last_position_ahead"] == 46  # the row that samples the last token; none after it


def test_a_full_pool_stops_running_ahead_and_the_scheduler_preempts(tiny_model_dir):
    """Blocks for the token after the one in flight are taken before that token is known; when the pool has
    none left, the step in flight is collected and the scheduler preempts in turn (recomputing later), with
    the tokens of step by step and every block back."""
    engine = Engine(model=tiny_model_dir, dtype="float32", attention_backend="torch", num_kv_blocks=14,
                    block_size=4, max_model_len=32, max_num_batched_tokens=32, num_speculative_tokens=0, enable_prefix_caching=False)
    reqs = [(p, _greedy(12)) for p in ([5, 6, 7, 8, 9], [42] * 9, list(range(300, 303)), [7, 8])]
    plain = _run(engine, False, reqs)
    preempted = engine.get_stats().num_preemptions
    ahead = _run(engine, True, reqs)
    _same(plain, ahead)
    assert preempted > 0 and engine.get_stats().num_preemptions > preempted  # both runs preempted


def test_stop_tokens_and_stop_strings_found_while_the_next_step_runs(engine):
    plain = _run(engine, False, [(p, _greedy(14)) for p in PROMPTS])
    tokens = [plain[f"q{i}"][-1][0][2] for i in range(len(PROMPTS))]
    texts = [plain[f"q{i}"][-1][0][1] for i in range(len(PROMPTS))]
    reqs = []
    for i, p in enumerate(PROMPTS):
        if i % 2:  # a stop token partway
            reqs.append((p, SamplingParams(max_tokens=14, temperature=0, stop_token_ids=[tokens[i][5]])))
        else:  # a stop string partway
            t = texts[i]
            reqs.append((p, _greedy(14, stop=[t[len(t) // 3: len(t) // 3 + 3]])))
    plain = _run(engine, False, reqs)
    ahead = _run(engine, True, reqs)
    _same(plain, ahead)
    assert any(out[-1][0][3] == "stop" for k, out in plain.items() if k.startswith("q"))


def test_seeds_logprobs_min_tokens_penalties_and_n(engine):
    reqs = [(PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3, logprobs=2,
                                        ignore_eos=True)),
            (PROMPTS[2], SamplingParams(max_tokens=9, temperature=0, min_tokens=6, logprobs=0)),
            (PROMPTS[3], SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True)),
            (PROMPTS[4], SamplingParams(max_tokens=7, n=2, temperature=1.0, seed=11, ignore_eos=True))]
    plain = _run(engine, False, reqs, OutputKind.DELTA)
    ahead = _run(engine, True, reqs, OutputKind.DELTA)
    _same(plain, ahead)


def test_penalized_requests_run_ahead_counting_their_token_in_flight(engine):
    """Penalties read a request's every token, the one still in flight too: a batch of penalized requests runs
    ahead (their counts kept on the device, that token read there from the step before's sampled ids) with the
    outputs of steps in turn, which differ from those without penalties."""
    kinds = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(repetition_penalty=1.8),
             dict(frequency_penalty=0.7, repetition_penalty=0.6, logit_bias={11: 3.0}), dict(logit_bias={12: 4.0})]
    prompts = [PROMPTS[2]] * 4 + [PROMPTS[0]]  # the model repeats its first token over and over after [42] * 17
    reqs = [(p, _greedy(14, **kw)) for p, kw in zip(prompts, kinds)]
    plain = _run(engine, False, reqs)
    ahead = _run(engine, True, reqs)
    _same(plain, ahead)
    assert ahead["ahead"] >= 10
    unpenalized = _run(engine, False, [(p, _greedy(14)) for p in prompts])
    assert all(plain[f"q{i}"] != unpenalized[f"q{i}"] for i in range(5))


def test_requests_short_of_min_tokens_run_ahead_banning_their_stop_ids_by_count(engine):
    """A request short of its `min_tokens` bans its stop ids by how many tokens it has, its token in flight
    too: steps queued ahead ban them up to the token before `min_tokens` and not at it. Each request's stop id
    is the token the model picks at index `min_tokens` (and not before), so it stops there, in both runs."""
    prompts = [PROMPTS[i] for i in (0, 1, 3, 4)]  # not [42] * 17, after which the model repeats one token
    free = _run(engine, False, [(p, _greedy(12)) for p in prompts])
    reqs = []
    for i, prompt in enumerate(prompts):
        tokens = free[f"q{i}"][-1][0][2]
        k = next(k for k in range(3 + i, 12) if tokens[k] not in tokens[:k])
        reqs.append((prompt, SamplingParams(max_tokens=12, temperature=0, min_tokens=k, stop_token_ids=[tokens[k]])))
    plain = _run(engine, False, reqs)
    ahead = _run(engine, True, reqs)
    _same(plain, ahead)
    assert ahead["ahead"] >= 3
    for i, (_, params) in enumerate(reqs):
        [(_, _, tokens, reason, stop, _), _] = plain[f"q{i}"][-1]
        assert reason == "stop" and stop == params.stop_token_ids[0] and len(tokens) == params.min_tokens + 1


def _words(engine: Engine, tokens: list[int], k: int, n: int) -> str | None:
    """The text of `tokens[k:k + n]` if bad words made from it ban exactly those ids (the text round-trips)."""
    text = engine.tokenizer.decode(tokens[k:k + n])
    return text if tokens[k:k + n] in bad_words_token_ids(engine.tokenizer, [text]) else None


def test_bad_words_run_ahead_banning_on_the_device_where_the_token_in_flight_begins_one(engine):
    """A bad word's last token is banned after its other tokens; one token ahead, where the token before it
    is still in flight, that ban is compared with it on the device (`SampleSpec.ban_after`). Each request's
    words are one, two and three tokens of what it says without them, so the bans change its output there:
    the same outputs as in turn, with every step after the prefill run ahead."""
    prompts = [PROMPTS[i] for i in (0, 1, 3, 4)]
    free = _run(engine, False, [(p, _greedy(14)) for p in prompts])
    reqs, where = [], []
    for i, prompt in enumerate(prompts):
        tokens = free[f"q{i}"][-1][0][2]
        n = (1, 2, 3, 2)[i]
        k, word = next((k, w) for k in range(2 + i, 14 - n) if (w := _words(engine, tokens, k, n)) is not None
                       and tokens[k + n - 1] not in tokens[:k + n - 1])
        reqs.append((prompt, _greedy(14, bad_words=[word])))
        where.append((k, n))
    plain = _run(engine, False, reqs)
    ahead = _run(engine, True, reqs)
    _same(plain, ahead)
    assert ahead["ahead"] >= 10
    for i, (k, n) in enumerate(where):
        before, after = free[f"q{i}"][-1][0][2], plain[f"q{i}"][-1][0][2]
        assert after[:k + n - 1] == before[:k + n - 1] and after[k + n - 1] != before[k + n - 1]


def test_under_a_grammar_the_forward_pass_runs_ahead_and_the_rows_sample_once_the_step_before_is_applied(engine):
    """A grammar's mask needs the token in flight on the host, so beside a constrained request a step queued
    ahead queues its forward pass only, and samples once the step in front is applied (`RunAhead.sample`):
    the constrained rows under masks from their grammars as advanced by that step's tokens, the others as
    ever. The same outputs as in turn, each constrained one following its grammar; grammars ending at
    different steps (a regex, a choice, a JSON schema) drop their rows from steps already queued."""
    pytest.importorskip("xgrammar")  # (not on a lent GPU machine, whose rehearsal runs this file)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    constrained = [StructuredOutputsParams(regex=r"[a-z]{3,6} \d{2}"),
                   StructuredOutputsParams(choice=["yes", "no way"]),
                   StructuredOutputsParams(json=schema, disable_any_whitespace=True)]
    reqs = [(PROMPTS[i], SamplingParams(max_tokens=24, temperature=0, structured_outputs=c))
            for i, c in enumerate(constrained)]
    reqs += [(PROMPTS[3], _greedy(20)), (PROMPTS[4], SamplingParams(max_tokens=18, temperature=0.9, seed=5,
                                                                   ignore_eos=True, frequency_penalty=0.5))]
    forwards = engine._ahead.forwards_queued
    plain = _run(engine, False, reqs, OutputKind.DELTA)
    assert engine._ahead.forwards_queued == forwards
    ahead = _run(engine, True, reqs, OutputKind.DELTA)
    _same(plain, ahead)
    deferred = engine._ahead.forwards_queued - forwards  # (once the grammars have ended, steps sample ahead)
    assert ahead["ahead"] >= 8 and 3 <= deferred < ahead["ahead"]
    text = ["".join(o[0][1] for o in plain[f"q{i}"]) for i in range(3)]
    assert re.fullmatch(r"[a-z]{3,6} \d{2}", text[0]) and text[1] in ("yes", "no way") and "a" in json.loads(text[2])
    assert all(plain[f"q{i}"][-1][0][3] == "stop" for i in range(3))  # each grammar ended its request


def test_aborts_and_requests_arriving_while_steps_run_ahead(engine):
    late = (PROMPTS[2], _greedy(6))

    def between(e: Engine, step: int) -> None:
        if step == 6:
            e.abort_request("q1")
        if step == 8:
            e.add_request("late", None, late[1], prompt_token_ids=late[0], output_kind=OutputKind.FINAL_ONLY)

    reqs = [(p, _greedy(16)) for p in PROMPTS[:3]]
    plain = _run(engine, False, reqs, between=between)
    ahead = _run(engine, True, reqs, between=between)
    _same(plain, ahead)
    assert "late" in ahead and ahead["late"][-1][-1]  # the late request was admitted and finished


def test_aborting_every_request_leaves_a_step_in_flight_that_the_next_step_drops(engine):
    engine.async_scheduling = True
    try:
        for i, p in enumerate(PROMPTS[:2]):
            engine.add_request(f"a{i}", None, _greedy(30), prompt_token_ids=p)
        while engine._inflight is None:
            engine.step()
        engine.abort_request(["a0", "a1"])
        assert not engine.has_unfinished_requests() and engine.kv_cache.usage == 0
        engine.add_request("b", None, _greedy(4), prompt_token_ids=PROMPTS[3], output_kind=OutputKind.FINAL_ONLY)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert [o.request_id for o in outs] == ["b"] and len(outs[0].outputs[0].token_ids) == 4
        assert engine._inflight is None and engine.kv_cache.usage == 0
    finally:
        engine.async_scheduling = False


def test_with_prefix_caching(tiny_model_dir):
    """Requests sharing a prefix, whose blocks are published as their decodes fill them while steps run
    ahead: the same outputs, and the next run hits the same prefixes."""
    engine = _engine(tiny_model_dir)
    shared = list(range(500, 540))
    reqs = [(shared + [i], _greedy(20 + i)) for i in range(4)]
    first = _run(engine, True, reqs)
    plain = _run(engine, False, reqs)
    ahead = _run(engine, True, reqs)
    _same(plain, ahead)
    assert {k: v for k, v in first.items() if k.startswith("q")} == {k: v for k, v in plain.items() if k.startswith("q")}
    assert engine.kv_cache.prefix_cache_hits > 0


def test_with_speculation_steps_run_ahead_above_the_batch_limit(tiny_model_dir):
    """With speculation and `speculative_disable_by_batch_size`, steps of more requests than the limit run ahead
    (no drafts there); once few enough run, the scheduler drafts again, in turn: the same outputs as without
    async scheduling, drafts made both ways. (A step already queued ahead when requests end runs without
    drafts, so the drafts, and the tokens computed for them, may fall on other steps.)"""
    engine = Engine(model=tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB",
                    max_num_batched_tokens=64, num_speculative_tokens=3, speculative_disable_by_batch_size=3,
                    enable_prefix_caching=False)
    # two short requests, then three, on two of which the random model repeats itself (lookups find drafts)
    reqs = [(PROMPTS[0], _greedy(2)), (PROMPTS[1], _greedy(3)), ([42] * 17, _greedy(30)), ([5, 6] * 9, _greedy(30)),
            (PROMPTS[3], _greedy(20))]
    drafts = []
    for ahead in (False, True):
        before = engine.get_stats().spec_num_drafts
        got = _run(engine, ahead, reqs)
        drafts.append(engine.get_stats().spec_num_drafts - before)
        if not ahead:
            plain = got
    assert all(drafts) and got["ahead"] > 0 and plain["ahead"] == 0
    assert {k: v for k, v in got.items() if k.startswith("q")} == {k: v for k, v in plain.items() if k.startswith("q")}


def test_async_scheduling_option(tiny_model_dir):
    from workers.config import EngineConfig

    # num_speculative_tokens defaults to 4, with no batch limit where no CUDA graphs are captured
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        EngineConfig(async_scheduling=True, device="cpu")
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        EngineConfig(async_scheduling=True, device="cuda", enforce_eager=True)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):  # known once the device is
        Engine(model=tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB",
               async_scheduling=True)
    assert EngineConfig(async_scheduling=True, speculative_disable_by_batch_size=8).async_scheduling
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(async_scheduling=True, num_speculative_tokens=0, tensor_parallel_size=2)
    e = Engine(model=tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB",
               num_speculative_tokens=0, async_scheduling=True)
    assert e.async_scheduling


def test_default_speculation_limit_keeps_drafting_steps_in_the_largest_graph(tiny_model_dir):
    """By default, where decode steps replay CUDA graphs, no drafts while more requests run than the largest graph
    holds with all their drafts (a step of more rows would run eagerly); no limit without graphs (the CPU) or
    drafts, and a limit given is kept."""
    from workers.config import EngineConfig, default_speculation_limit

    config = EngineConfig(max_num_seqs=256)
    assert config.num_speculative_tokens == 4 and config.speculative_disable_by_batch_size is None
    assert default_speculation_limit(config, 256) == 51  # 51 requests x 5 rows fit 256, 52 do not
    assert default_speculation_limit(config, None) is None
    assert default_speculation_limit(EngineConfig(num_speculative_tokens=0), 256) is None
    assert default_speculation_limit(EngineConfig(speculative_disable_by_batch_size=300), 256) == 300
    assert default_speculation_limit(EngineConfig(num_speculative_tokens=4, max_num_seqs=2), 2) == 1
    e = Engine(model=tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB")
    assert e.runner.graphs is None and e.scheduler.config.speculative_disable_by_batch_size is None


def test_an_engine_with_decode_graphs_limits_speculation_to_the_largest_graph(tiny_model_dir, monkeypatch):
    """The engine resolves the limit from the graphs its runner captured (here replayed eagerly on the CPU,
    with the Triton backend under the interpreter, as a GPU's would be)."""
    from workers import engine as engine_module
    from workers.cuda_graphs import eager_capture

    make_runner = engine_module.make_runner

    def with_graphs(model, attn, config, num_blocks, dtype, device, max_model_len, structured=None):
        runner = make_runner(model, attn, config, num_blocks, dtype, device, max_model_len, structured)
        runner.enable_decode_graphs(config.max_num_seqs, max_model_len, capture=eager_capture)
        return runner

    monkeypatch.setattr(engine_module, "make_runner", with_graphs)
    e = Engine(model=tiny_model_dir, dtype="float32", attention_backend="triton", kv_cache_memory="16MiB",
               max_num_seqs=10, num_speculative_tokens=3)
    assert e.runner.graphs.sizes[-1] == 10 and e.scheduler.config.speculative_disable_by_batch_size == 2
    assert not e.async_scheduling  # the CPU: async scheduling is a GPU's default
