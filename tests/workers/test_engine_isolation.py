"""One bad request never hurts another: a request that breaks a step fails alone, with its error, its
blocks back in the pool, and the requests beside it finish with exactly the tokens they get alone."""

from __future__ import annotations

import math
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.config import EngineConfig
from workers.engine import Engine
from workers.engine_loop import EngineLoop
from workers.messages import GenerateRequest
from workers.sampling_params import SamplingParams

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": list(range(100, 140)), "c": [42] * 20}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# greedy with a seed: its step builds a generator for it (a batch of plain greedy rows builds none, and samples
# through `launch_greedy`), where the tests below break one request's preparation
SEEDED = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, seed=7)


@pytest.fixture(scope="module", params=[{}, {"num_speculative_tokens": 0, "async_scheduling": True}],
                ids=["in-turn", "async"])
def engine(tiny_model_dir, request) -> Engine:
    """Step by step (with speculation, the default), and with each decode step queued behind the one before
    (async scheduling, on by default on a GPU): a step that fails there is run again in turn."""
    return Engine(EngineConfig(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                               **request.param))


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], poison=None):
    """Add `requests`, let `poison(engine)` break some behind validation, step to the end. Returns the
    finished token ids per request (one list per sequence) and the failures."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    if poison is not None:
        poison(engine)
    finished, failed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [c.token_ids for c in out.outputs]
        failed.update(engine.failed)
    return finished, failed


@pytest.fixture(scope="module")
def alone(engine) -> dict[str, list[list[int]]]:
    """Each bystander's greedy tokens when it runs by itself."""
    return {rid: run(engine, {rid: (prompt, GREEDY)})[0][rid] for rid, prompt in PROMPTS.items()}


def assert_clean(engine: Engine) -> None:
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests() and stats.kv_cache_usage == 0.0
    assert stats.num_running == 0 and stats.num_waiting == 0 and not engine.runner.generators


def _with_bad(bad: SamplingParams, bad_prompt: list[int] | None = None) -> dict:
    return {**{rid: (p, GREEDY) for rid, p in PROMPTS.items()}, "bad": (bad_prompt or [11, 12, 13], bad)}


def _set_seed(value: int):
    def poison(engine: Engine) -> None:
        for req in engine.scheduler.requests.values():
            if req.parent_id == "bad":
                req.seed = value
    return poison


def test_overflowing_seed_fails_only_its_request(engine, alone):
    finished, failed = run(engine, _with_bad(SamplingParams(max_tokens=8, seed=1)), _set_seed(2**64))
    assert finished == alone and list(failed) == ["bad"]
    assert "Overflow" in failed["bad"] and "'bad'" in failed["bad"]
    assert_clean(engine)


def test_one_failing_sibling_fails_its_whole_request(engine, alone):
    def poison(engine: Engine) -> None:
        engine.scheduler.requests["bad#1"].seed = -2**63 - 1

    finished, failed = run(engine, _with_bad(SamplingParams(n=3, max_tokens=8, seed=1)), poison)
    assert finished == alone and list(failed) == ["bad"]
    assert_clean(engine)


def test_preparation_error_of_one_request(engine, alone, monkeypatch):
    real = engine.runner._generator

    def generator(request_id: str, seed: int | None):
        if request_id == "bad":
            raise RuntimeError("cannot build this request's generator")
        return real(request_id, seed)

    monkeypatch.setattr(engine.runner, "_generator", generator)
    finished, failed = run(engine, _with_bad(SEEDED))
    assert finished == alone and "cannot build" in failed["bad"]
    assert_clean(engine)


def test_sampling_failure_is_found_by_bisection(engine, alone):
    def poison(engine: Engine) -> None:
        engine.scheduler.requests["bad"].sampling_params.top_k = None  # as if changed after validation

    finished, failed = run(engine, _with_bad(SamplingParams(max_tokens=8, temperature=1.0)), poison)
    assert finished == alone and list(failed) == ["bad"]
    assert_clean(engine)


def test_forward_failure_is_found_by_bisection(engine, alone, monkeypatch):
    real = engine.runner.model

    class Model:  # the real model, whose forward pass fails on one token
        def __call__(self, input_ids, *args):
            if bool((input_ids == 4242).any()):
                raise RuntimeError("the forward pass broke")
            return real(input_ids, *args)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(engine.runner, "model", Model())
    finished, failed = run(engine, _with_bad(GREEDY, bad_prompt=[1, 4242, 3]))
    assert finished == alone and "forward pass broke" in failed["bad"]
    assert_clean(engine)


def test_seeded_bystander_keeps_its_noise_when_its_step_is_retried(engine):
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    reference = run(engine, {"s": (PROMPTS["a"], seeded)})[0]["s"]

    def poison(engine: Engine) -> None:  # fails after the step's noise is drawn: more logprobs than tokens
        engine.scheduler.requests["bad"].sampling_params.logprobs = engine.vocab_size + 1

    finished, failed = run(engine, {"s": (PROMPTS["a"], seeded), "bad": ([9, 9], SamplingParams(temperature=1.0))},
                           poison)
    assert finished == {"s": reference} and list(failed) == ["bad"]
    assert_clean(engine)


def test_engine_loop_publishes_the_error_and_serves_the_others(engine, alone, monkeypatch):
    real = engine.runner._generator
    monkeypatch.setattr(engine.runner, "_generator",
                        lambda rid, seed: (_ for _ in ()).throw(RuntimeError("boom")) if rid == "bad" else real(rid, seed))
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    errors: dict[str, str] = {}
    done = threading.Event()

    def publish(outputs, errs, stats, exports) -> None:
        for out in outputs:
            tokens[out.request_id] += out.outputs[0].token_ids
        errors.update(errs)
        if not engine.has_unfinished_requests():
            done.set()

    loop = EngineLoop(lambda: engine, publish)
    for rid, prompt in [*PROMPTS.items(), ("bad", [1, 2, 3])]:
        loop.add(GenerateRequest(rid, prompt, SEEDED if rid == "bad" else GREEDY))
    loop.start()
    try:
        assert done.wait(60)
    finally:
        loop.stop()
    assert {rid: [t] for rid, t in tokens.items()} == alone and list(errors) == ["bad"] and "boom" in errors["bad"].message
    assert errors["bad"].status == 500  # the engine's fault, not the request's
    assert_clean(engine)


_ints = st.one_of(st.integers(-3, 40), st.sampled_from([2**63 - 1, 2**63, 2**64, -2**63, -2**63 - 1]))
_floats = st.one_of(st.floats(-1, 3), st.sampled_from([math.nan, math.inf, -math.inf, 1e-30, 1e30]))
_params = st.fixed_dictionaries({}, optional={
    "n": _ints, "max_tokens": st.one_of(st.none(), _ints), "temperature": _floats, "top_p": _floats, "top_k": _ints,
    "seed": st.one_of(st.none(), _ints), "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=2))),
    "stop_token_ids": st.lists(_ints, max_size=3), "ignore_eos": st.booleans(), "logprobs": st.one_of(st.none(), _ints),
    "min_tokens": _ints, "skip_special_tokens": st.sampled_from([True, False, 1, None]),
})
_poisons = st.sampled_from([None, ("seed", 2**64), ("seed", -2**63 - 1), ("top_k", 2**63), ("temperature", math.nan),
                            ("logprobs", 10**6)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=st.lists(_params, min_size=1, max_size=3), poison=_poisons, priority=_ints)
def test_random_params_never_hurt_bystanders(engine, alone, kwargs, poison, priority):
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    added = []
    for i, kw in enumerate(kwargs):
        try:
            engine.add_request(f"x{i}", [7, 8, 9, 10][: 1 + i], SamplingParams(**kw), priority=priority)
        except ValueError:
            continue
        added.append(f"x{i}")
    if poison is not None:  # values that got past validation (changed afterwards): the step must isolate them
        field, value = poison
        for req in engine.scheduler.requests.values():
            if req.parent_id in added:
                setattr(req if field == "seed" else req.sampling_params, field, value)
    finished, failed = {}, {}
    deadline = time.monotonic() + 60
    while not set(PROMPTS) <= set(finished):
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [c.token_ids for c in out.outputs]
        failed.update(engine.failed)
    engine.abort_request(engine.unfinished_request_ids())
    assert {rid: finished[rid] for rid in PROMPTS} == alone and set(failed) <= set(added)
    assert_clean(engine)
