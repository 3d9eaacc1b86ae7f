"""Speculation by n-gram prompt lookup (`num_speculative_tokens`): greedy requests give the same tokens,
finish reasons and streamed text as without it, in fewer steps; drafts stop at every stop condition; requests
whose tokens are decided one at a time never speculate; every KV block comes back."""

from __future__ import annotations

import numpy as np
import pytest

from workers.config import EngineConfig
from workers.engine import Engine
from workers.metrics import EngineMetrics
from workers.ngram import TokenArray, accept_drafts, propose
from workers.output_processor import OutputKind
from workers.sampler import SampleOutput
from workers.sampling_params import SamplingParams

TEXTS = {"a": "one two three four five six seven eight " * 3, "c": "The cat sat on the mat. The dog sat on the log. The"}


@pytest.fixture(scope="module")
def prompts(tokenizer, make_prompts) -> dict[str, list[int]]:
    """Text that repeats itself (the model copies it, so lookups find drafts it agrees with) and a corpus
    prompt (whose drafts it mostly rejects)."""
    ids = {rid: tokenizer(t, add_special_tokens=False).input_ids for rid, t in TEXTS.items()}
    return {"a": ids["a"], "b": make_prompts([48])[0], "c": ids["c"]}


def test_propose_takes_the_latest_occurrence_of_the_longest_suffix():
    assert propose([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 2, 3, 1) == [4, 5]  # latest [1, 2, 3]
    assert propose([7, 1, 2, 8, 5, 2], 3, 3, 1) == [8, 5, 2]  # only [2] occurred before
    assert propose([7, 1, 2, 8, 5, 2], 3, 3, 2) == []  # ...which is shorter than min_n
    assert propose([1, 2, 1, 2], 5, 4, 1) == [1, 2]  # no further than the sequence goes
    assert propose([1, 2, 3, 1, 2], 0, 4, 1) == [] and propose([5], 3, 4, 1) == []
    # the last token's 42 earlier places narrowed in numpy: none is preceded by another 5 (the first, at 0, by
    # nothing), so no suffix of 2 tokens occurred before; the latest 1-token one is the 5 after the 7
    many = [5] + [9, 5] * 40 + [7, 5, 5]
    assert propose(many, 4, 4, 2) == [] and propose(many, 4, 4, 1) == [5]


def test_a_token_array_kept_up_to_date_proposes_as_the_list_does():
    """`TokenArray`: a request's history as int64, extended by what was appended since it was last read; copied
    anew for another list or one that shrank. Its drafts are the list's, step by step."""
    import random

    rng = random.Random(0)
    tokens, arr = [rng.randrange(6) for _ in range(5)], TokenArray()
    for step in range(400):  # past the first buffer (256) and its doubling
        tokens += [rng.randrange(6) for _ in range(rng.choice([1, 1, 1, 3]))]
        view = arr.of(tokens)
        assert view.tolist() == tokens
        assert propose(view, 4, 4, 1) == propose(tokens, 4, 4, 1), step
    other = [9, 8, 9, 8]
    assert arr.of(other).tolist() == other  # another list
    del other[2:]
    other.append(5)
    assert arr.of(other).tolist() == [9, 8, 5]  # shorter than when last read: copied anew


def _propose_by_definition(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for s in range(len(tokens) - n - 1, -1, -1):  # the latest earlier window first
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 5, 50, 5000])
def test_propose_finds_the_latest_longest_earlier_suffix(vocab):
    """Drafts as the definition gives them (the longest suffix of max_n..min_n tokens that occurred before, its
    latest place), over histories whose last token occurred before in a few places (Python's extension) and in
    hundreds (numpy's), with list and array input."""
    import random

    rng = random.Random(vocab)
    many = 0
    for trial in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 700))]
        if rng.random() < 0.3 and len(tokens) > 8:  # a repeated run, as text that repeats itself has
            start = rng.randrange(len(tokens) - 6)
            tokens += tokens[start:start + rng.randrange(1, 6)]
        k, max_n = rng.randrange(0, 6), rng.randrange(1, 6)
        min_n = rng.randrange(1, max_n + 1)
        want = _propose_by_definition(tokens, k, max_n, min_n) if k and len(tokens) > min_n else []
        assert propose(tokens, k, max_n, min_n) == want, (trial, k, max_n, min_n)
        assert propose(np.asarray(tokens, dtype=np.int64), k, max_n, min_n) == want, trial
        many += tokens[:-1].count(tokens[-1]) > 32
    if vocab <= 5:
        assert many > 100  # the numpy path ran


def test_which_requests_may_draft_is_decided_once_but_min_tokens_each_step():
    """`Scheduler._may_speculate`: what never changes in a request's life (greedy, no logprobs, penalties, stop
    strings, bad words, KV hand-off) is decided on the first ask and kept (`Request.may_draft`); `min_tokens`
    is checked each step as the output grows."""
    from workers.request import Request
    from workers.scheduler import Scheduler

    def request(hold_kv: bool = False, **params) -> Request:
        r = Request("r", [1, 2, 3], SamplingParams(**{"temperature": 0, "max_tokens": 9, **params}), 9,
                    hold_kv=hold_kv)
        r.all_token_ids = [1, 2, 3]
        return r

    r = request(min_tokens=2)
    verdicts = []
    for token in (7, 8, 9):
        verdicts.append(Scheduler._may_speculate(r))
        r.all_token_ids.append(token)
    assert verdicts == [False, False, True] and r.may_draft is True  # past min_tokens once 2 were made
    for r in (request(logprobs=1), request(stop=["x"]), request(hold_kv=True), request(temperature=0.7)):
        assert not Scheduler._may_speculate(r) and r.may_draft is False
    r = request()
    r.may_draft = False  # decided before: not asked again
    assert not Scheduler._may_speculate(r)


def test_accept_drafts_keeps_the_agreeing_prefix_and_the_models_next_token():
    out = SampleOutput([10, 11, 99, 12, 5, 20, 21], [None] * 7)
    folded = accept_drafts(out, ["a", "a", "a", "a", "b", "c", "c"], [[10, 11, 13], [], [20]])
    assert folded.token_ids == [99, 5, 21]  # a: 2 drafts kept, then the model's 99; b: no drafts; c: all kept
    assert folded.accepted == {"a": 2, "c": 1}  # how many of its drafts each request keeps


def _engine(model: str, dtype: str = "float32", **options) -> Engine:
    """An engine without speculation unless `options` ask for it (it is on by default)."""
    options.setdefault("num_speculative_tokens", 0)
    blocks = options.pop("num_kv_blocks", 64)
    return Engine(model=model, dtype=dtype, num_kv_blocks=blocks, num_threads=2,
                  max_model_len=blocks * options.get("block_size", 16), **options)


def _run(engine: Engine, params: dict[str, SamplingParams], prompts: dict[str, list[int]],
         kind: OutputKind = OutputKind.FINAL_ONLY) -> tuple[dict[str, list], int]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, None, params[rid], prompt_token_ids=prompt, output_kind=kind)
    outputs: dict[str, list] = {rid: [] for rid in prompts}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.get_stats().kv_cache_usage == 0
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks
    return outputs, steps


def _finals(outputs: dict[str, list]) -> dict[str, tuple]:
    return {rid: (o[-1].outputs[0].token_ids, o[-1].outputs[0].text, o[-1].outputs[0].finish_reason,
                  o[-1].outputs[0].stop_reason) for rid, o in outputs.items()}


@pytest.fixture(scope="module")
def plain_40(default_model_dir, prompts) -> tuple[dict[str, list], int]:
    """Every prompt's 40 greedy tokens without speculation, and the steps they took: the reference of the
    tests below that change nothing else."""
    params = {rid: SamplingParams(max_tokens=40, temperature=0, ignore_eos=True) for rid in prompts}
    return _run(_engine(default_model_dir), params, prompts)


def test_same_tokens_in_fewer_steps(default_model_dir, prompts, plain_40):
    params = {rid: SamplingParams(max_tokens=40, temperature=0, ignore_eos=True) for rid in prompts}
    plain, plain_steps = plain_40
    spec_engine = _engine(default_model_dir, num_speculative_tokens=4)
    spec, spec_steps = _run(spec_engine, params, prompts)
    assert _finals(spec) == _finals(plain)
    s = spec_engine.scheduler
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert spec_steps < plain_steps
    assert spec_engine.get_stats().generation_tokens == 3 * 40


def test_on_by_default_for_greedy_requests_only(default_model_dir, prompts):
    engine = Engine(model=default_model_dir, dtype="float32", num_kv_blocks=64, num_threads=2, max_model_len=1024)
    assert engine.config.num_speculative_tokens == 4
    params = {"a": SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)}
    _run(engine, params, {"a": prompts["a"]})
    assert engine.scheduler.num_accepted_tokens > 0
    drafted = engine.scheduler.num_draft_tokens
    _run(engine, {"s": SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True)}, {"s": prompts["a"]})
    assert engine.scheduler.num_draft_tokens == drafted  # OpenAI's default, temperature 1: never drafts


def test_prometheus_counts_drafts_and_what_was_kept_by_position(default_model_dir, prompts):
    engine, metrics = _engine(default_model_dir, num_speculative_tokens=4), EngineMetrics("r0")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        metrics.observe_step(engine.get_stats(), engine.step())
    metrics.observe_step(engine.get_stats(), [])
    s = engine.scheduler
    exposed = {(sample.name, sample.labels.get("position")): sample.value
               for family in metrics.registry.collect() for sample in family.samples
               if sample.name.startswith("kvrelay:spec_decode_")}
    assert exposed[("kvrelay:spec_decode_num_drafts_total", None)] == s.num_drafts > 0
    assert exposed[("kvrelay:spec_decode_num_draft_tokens_total", None)] == s.num_draft_tokens
    assert s.num_drafts <= s.num_draft_tokens <= 4 * s.num_drafts
    assert exposed[("kvrelay:spec_decode_num_accepted_tokens_total", None)] == s.num_accepted_tokens > 0
    per_pos = [exposed[("kvrelay:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(4)]
    assert sum(per_pos) == s.num_accepted_tokens
    # a draft is kept only after every draft before it was: the counts never grow with the position
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= s.num_drafts


@pytest.mark.parametrize("at", [3, 10, 25])
def test_drafts_stop_at_stop_tokens_and_max_tokens(default_model_dir, prompts, plain_40, at):
    ref, _ = plain_40
    # stop on a token each output takes somewhere in the middle, and a max_tokens inside a draft run
    params = {rid: SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ref[rid][-1].outputs[0].token_ids[at]])
              for rid in prompts}
    params["c"] = SamplingParams(max_tokens=at + 2, temperature=0, ignore_eos=True)
    plain, _ = _run(_engine(default_model_dir), params, prompts)
    spec_engine = _engine(default_model_dir, num_speculative_tokens=6)
    spec, _ = _run(spec_engine, params, prompts)
    assert _finals(spec) == _finals(plain)
    assert len(spec["c"][-1].outputs[0].token_ids) == at + 2
    assert spec_engine.scheduler.num_accepted_tokens > 0


def test_streamed_deltas_add_up_to_the_same_completion(default_model_dir, prompts):
    params = {rid: SamplingParams(max_tokens=30, temperature=0, ignore_eos=True) for rid in prompts}
    plain, _ = _run(_engine(default_model_dir), params, prompts)
    spec, _ = _run(_engine(default_model_dir, num_speculative_tokens=4), params, prompts, kind=OutputKind.DELTA)
    for rid in prompts:
        assert [t for o in spec[rid] for t in o.outputs[0].token_ids] == plain[rid][-1].outputs[0].token_ids
        assert "".join(o.outputs[0].text for o in spec[rid]) == plain[rid][-1].outputs[0].text
        assert any(len(o.outputs[0].token_ids) > 1 for o in spec[rid])  # some step gave several tokens


def test_requests_decided_token_by_token_never_speculate(default_model_dir, prompts):
    params = {"a": SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
              "b": SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True),
              "c": SamplingParams(max_tokens=20, temperature=0, stop=["never"], repetition_penalty=1.2)}
    plain, _ = _run(_engine(default_model_dir), params, prompts)
    engine = _engine(default_model_dir, num_speculative_tokens=4)
    spec, _ = _run(engine, params, prompts)
    assert _finals(spec) == _finals(plain)
    assert engine.scheduler.num_draft_tokens == 0


def test_batches_larger_than_the_limit_do_not_speculate(default_model_dir, prompts):
    params = {rid: SamplingParams(max_tokens=20, temperature=0, ignore_eos=True) for rid in prompts}
    engine = _engine(default_model_dir, num_speculative_tokens=4, speculative_disable_by_batch_size=2)
    _run(engine, params, prompts)
    drafts_with_three = engine.scheduler.num_draft_tokens
    engine2 = _engine(default_model_dir, num_speculative_tokens=4, speculative_disable_by_batch_size=2)
    _run(engine2, {"a": params["a"]}, {"a": prompts["a"]})
    assert engine2.scheduler.num_draft_tokens > drafts_with_three  # three at once never drafted; one did


def _drafts_per_step(engine: Engine, params: dict[str, SamplingParams], prompts: dict[str, list[int]],
                     finals: dict | None = None) -> list[dict]:
    """`_run`, recording how many drafts each scheduled request computes in each step (and in `finals`, if
    given, each request's final output: `_finals`)."""
    steps, schedule = [], engine.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append({r.request_id: len(r.spec_token_ids) for r in out.requests})
        return out

    engine.scheduler.schedule = recorded
    outputs, _ = _run(engine, params, prompts)
    if finals is not None:
        finals.update(_finals(outputs))
    return steps


class _Share:
    """A `StepCosts` whose rows always cost `share` of a step."""

    def __init__(self, share: float | None) -> None:
        self.share, self.observed = share, []

    def observe(self, rows: int, seconds: float) -> None:
        self.observed.append((rows, seconds))

    def row_share(self, rows: int) -> float | None:
        return self.share


def _spec_engine(model: str, share: float | None) -> Engine:
    """An engine that speculates, its drafts' odds by `share` (None: SPEC_KEEP_ODDS, as before the steps tell)
    rather than by the timing of its steps."""
    engine = _engine(model, num_speculative_tokens=4)
    engine.scheduler.step_costs = _Share(share)
    return engine


def test_beside_others_a_request_drafts_what_its_record_earns(default_model_dir, prompts, monkeypatch):
    """Drafts that are always refused: alone a request keeps drafting in full (its rows are nearly free);
    beside another it stops after its first refusal and then drafts one token every 8th step to learn
    again. A request whose drafts are kept drafts in full beside others. (Odds of 0.5 needed: the engine's
    own steps, timed, would move them.)"""
    params = {rid: SamplingParams(max_tokens=40, temperature=0, ignore_eos=True) for rid in prompts}
    monkeypatch.setattr("workers.scheduler.propose", lambda tokens, k, max_n, min_n: [7] * k)  # never kept
    alone = _drafts_per_step(_engine(default_model_dir, num_speculative_tokens=4), {"a": params["a"]},
                             {"a": prompts["a"]})
    assert [d["a"] for d in alone[1:-4]] == [4] * (len(alone) - 5)  # in full, until max_tokens leaves less room
    engine = _spec_engine(default_model_dir, None)
    together = _drafts_per_step(engine, params, prompts)
    for rid in prompts:
        drafts = [d.get(rid, 0) for d in together]
        first = next(i for i, n in enumerate(drafts) if n)
        assert drafts[first] == 2  # a new record: each draft kept at 0.75, the second at 0.56 >= 0.5
        later = [i for i, n in enumerate(drafts) if n and i > first]
        assert all(drafts[i] == 1 for i in later) and len(later) >= 3
        assert [b - a for a, b in zip([first] + later, later)] == [8] * len(later)  # probes, 8 steps apart
    assert engine.scheduler.num_accepted_tokens == 0
    monkeypatch.undo()
    engine = _spec_engine(default_model_dir, None)
    kept = _drafts_per_step(engine, params, prompts)
    a = [d.get("a", 0) for d in kept]  # text that repeats itself: the model agrees with its drafts
    assert 4 in a[a.index(2) + 1:]  # from two drafts (a new record) to four, once they were kept


def test_beside_others_the_odds_a_draft_needs_follow_what_a_row_costs(default_model_dir, prompts):
    """Where rows cost nearly all of a step, a new record's odds (0.75) earn no draft beside others, and a request
    whose drafts are kept drafts less than where rows cost little; alone it drafts in full either way. The
    tokens are the same."""
    params = {rid: SamplingParams(max_tokens=40, temperature=0, ignore_eos=True) for rid in prompts}
    runs, finals = {}, {0.0: {}, 1.0: {}}
    for share in (0.0, 1.0):
        engine = _spec_engine(default_model_dir, share)
        runs[share] = (_drafts_per_step(engine, params, prompts, finals[share]), engine)
    assert finals[0.0] == finals[1.0]
    cheap, dear = ([d.get("a", 0) for d in runs[share][0]] for share in (0.0, 1.0))
    first = next(i for i, n in enumerate(cheap) if n)
    assert cheap[first] == 4  # a new record's drafts: 0.75, 0.56, 0.42, 0.32, all >= 0.25
    probes = [i for i, n in enumerate(dear) if n]  # none reach 0.95: only probes, every 8th step
    assert probes and all(dear[i] == 1 for i in probes) and all((b - a) % 8 == 0 for a, b in zip(probes, probes[1:]))
    assert sum(dear) < sum(cheap)
    assert runs[1.0][1].scheduler.num_accepted_tokens > 0  # its probes were kept
    alone = _drafts_per_step(_spec_engine(default_model_dir, 1.0), {"a": params["a"]}, {"a": prompts["a"]})
    assert 4 in [d["a"] for d in alone]  # alone it drafts in full whatever rows cost beside others


def _timed_steps(engine: Engine, params: dict[str, SamplingParams], prompts: dict[str, list[int]]) -> list:
    """`_run` with the step costs recorded (`_Share`): each step's (requests, rows) if it was decode-only, else
    None, and the (rows, seconds) the engine gave the step costs."""
    engine.scheduler.step_costs = _Share(None)
    steps, schedule = [], engine.scheduler.schedule

    def recorded():
        out = schedule()
        decode = not out.admitted and all(r.num_computed_tokens + 1 == len(r.all_token_ids)
                                          for r in out.requests)
        steps.append((len(out.requests), out.total_num_tokens) if decode else None)
        return out

    engine.scheduler.schedule = recorded
    _run(engine, params, prompts)
    return steps, engine.scheduler.step_costs.observed


def test_the_engine_times_its_decode_steps_for_the_rows_cost(default_model_dir, prompts):
    """The engine gives `StepCosts` each decode-only step's rows (requests and their drafts) and time, and no
    step that computes a prompt; while more requests run than `speculative_disable_by_batch_size` (no drafts
    decided) none."""
    params = {rid: SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for rid in prompts}
    steps, observed = _timed_steps(_engine(default_model_dir, num_speculative_tokens=4), params, prompts)
    assert [rows for rows, _ in observed] == [s[1] for s in steps if s is not None]
    assert None in steps and any(s[1] > s[0] for s in steps if s)  # prompts, and steps with drafts
    assert all(seconds > 0 for _, seconds in observed)
    limited = _engine(default_model_dir, num_speculative_tokens=4, speculative_disable_by_batch_size=2)
    early = {**params, "b": SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)}  # then two run
    steps, observed = _timed_steps(limited, early, prompts)
    assert [rows for rows, _ in observed] == [s[1] for s in steps if s is not None and s[0] <= 2]
    assert any(s[0] == 3 for s in steps if s) and observed  # three running: not timed; two: timed
    real = _engine(default_model_dir, num_speculative_tokens=4)  # the engine's own: it learns the rows' share
    _run(real, params, prompts)
    assert real.scheduler.step_costs.row_share(3) is not None


def test_preemption_under_a_small_pool_gives_the_same_tokens(default_model_dir, prompts):
    params = {rid: SamplingParams(max_tokens=40, temperature=0, ignore_eos=True) for rid in prompts}
    plain, _ = _run(_engine(default_model_dir, num_kv_blocks=14, block_size=8), params, prompts)
    engine = _engine(default_model_dir, num_kv_blocks=14, block_size=8, num_speculative_tokens=4)
    spec, _ = _run(engine, params, prompts)
    assert _finals(spec) == _finals(plain)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_accepted_tokens > 0


def test_bfloat16_one_stream_gives_the_same_tokens(default_model_dir, make_prompts):
    """One stream's rows stay on the decode kernels, whose rows are computed alike at any count up to 8."""
    prompt = {"a": make_prompts([96])[0]}
    params = {"a": SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)}
    plain, plain_steps = _run(_engine(default_model_dir, "bfloat16", num_kv_blocks=32), params, prompt)
    spec, spec_steps = _run(_engine(default_model_dir, "bfloat16", num_kv_blocks=32, num_speculative_tokens=4),
                            params, prompt)
    assert _finals(spec) == _finals(plain)
    assert spec_steps < plain_steps


@pytest.mark.parametrize("options, field", [({"num_speculative_tokens": -1}, "num_speculative_tokens"),
                                            ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
                                            ({"prompt_lookup_min": 5, "prompt_lookup_max": 4}, "prompt_lookup_min"),
                                            ({"speculative_disable_by_batch_size": 1.5},
                                             "speculative_disable_by_batch_size")])
def test_bad_options_are_refused(options, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**options)
