"""Overlapped outputs (`Engine.overlap_outputs`, on by default on a GPU): a step's outputs are made while the
next step runs, reported one step later. Here on the CPU, forced on: the same requests give the same outputs
as step by step (stop strings, n > 1, seeds, logprobs, min_tokens, stream deltas), an abort between steps
forgets a request whose outputs were pending, and every block goes back to the pool."""

from __future__ import annotations

import pytest

from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 17, list(range(300, 303)), list(range(7, 30))]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(model=tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB",
                  max_num_batched_tokens=32)  # prefill chunks, decodes and mixed steps


def _run(engine: Engine, overlap: bool, requests: list[tuple[list[int], SamplingParams]],
         kind: OutputKind = OutputKind.FINAL_ONLY) -> dict[str, list]:
    """Every output each request reported, in order, and the tokens the steps computed (a request a stop
    string ended while its next token was in flight must not count that token)."""
    engine.overlap_outputs = overlap
    computed = engine.get_stats().computed_tokens
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"q{i}", None, params, prompt_token_ids=ids, output_kind=kind)
    got: dict[str, list] = {f"q{i}": [] for i in range(len(requests))}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append([(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                         _rounded(c.logprobs)) for c in out.outputs] + [out.finished])
        steps += 1
        assert steps < 500
    assert engine._pending is None and engine.kv_cache.usage == 0
    got["computed_tokens"] = engine.get_stats().computed_tokens - computed
    return got


def _rounded(logprobs):
    """Logprobs to 4 places: a stop string found a step later keeps its request in one more batch, and a
    batch of another size may round a float32 logprob differently in the last place."""
    if logprobs is None:
        return None
    return [{t: (round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in pos.items()} for pos in logprobs]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_overlapped_outputs_equal_step_by_step(engine):
    plain = _run(engine, False, [(p, _greedy(14)) for p in PROMPTS])
    texts = [plain[f"q{i}"][-1][0][1] for i in range(len(PROMPTS))]
    # stop strings the greedy texts reach partway: cut there, found one step later with overlap
    stops = [t[len(t) // 3: len(t) // 3 + 3] for t in texts]
    requests = [(PROMPTS[0], _greedy(14, stop=[stops[0]])),
                (PROMPTS[1], _greedy(9, logprobs=3)),
                (PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.9, seed=7, n=2, ignore_eos=True)),
                (PROMPTS[3], _greedy(14, stop=[stops[3]], include_stop_str_in_output=True)),
                (PROMPTS[4], SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3, min_tokens=4))]
    for kind in (OutputKind.FINAL_ONLY, OutputKind.DELTA, OutputKind.CUMULATIVE):
        step_by_step = _run(engine, False, requests, kind)
        overlapped = _run(engine, True, requests, kind)
        assert overlapped == step_by_step, kind
    final = step_by_step["q0"][-1][0]
    assert final[3] == "stop" and final[4] == stops[0] and len(final[2]) < 14


def test_outputs_come_one_step_later_and_the_last_ones_with_nothing_to_schedule(engine):
    engine.overlap_outputs = True
    engine.add_request("a", None, _greedy(3), prompt_token_ids=PROMPTS[0], output_kind=OutputKind.DELTA)
    assert engine.step() == []  # the prefill's first token: made during the next step
    first = engine.step()
    assert [len(o.outputs[0].token_ids) for o in first] == [1]
    assert [len(o.outputs[0].token_ids) for o in engine.step()] == [1]
    assert engine.has_unfinished_requests() and not engine.scheduler.has_unfinished_requests()
    last = engine.step()  # nothing to schedule: the pending outputs
    assert len(last) == 1 and last[0].finished and not engine.has_unfinished_requests()
    assert engine.step() == []


def test_an_abort_between_steps_forgets_pending_outputs(engine):
    engine.overlap_outputs = True
    for rid, p in (("x", PROMPTS[1]), ("y", PROMPTS[2])):
        engine.add_request(rid, None, _greedy(20), prompt_token_ids=p, output_kind=OutputKind.DELTA)
    for _ in range(6):
        engine.step()
    assert engine._pending is not None and "x" in {r.request_id for r in engine._pending.sampled}
    engine.abort_request("x")
    seen = set()
    while engine.has_unfinished_requests():
        seen |= {o.request_id for o in engine.step()}
    assert seen == {"y"} and engine.kv_cache.usage == 0


def test_overlapped_outputs_with_speculation(tiny_model_dir):
    """Drafts proposed from the tokens of the step before the last: accepted drafts come in the same
    outputs, and a stop string inside them is still found one step later with nothing extra."""
    engine = Engine(model=tiny_model_dir, dtype="float32", attention_backend="torch", kv_cache_memory="16MiB",
                    num_speculative_tokens=4)
    # the odds a draft needs at a fixed value: learnt from the steps' timings (`StepCosts`), they could let
    # one run draft a token more than the other, and the tokens computed would differ by it
    engine.scheduler.step_costs = None
    plain = _run(engine, False, [(p, _greedy(24)) for p in PROMPTS])
    texts = [plain[f"q{i}"][-1][0][1] for i in range(len(PROMPTS))]
    requests = [(p, _greedy(24, stop=[t[len(t) // 2: len(t) // 2 + 2]] if i % 2 else None))
                for i, (p, t) in enumerate(zip(PROMPTS, texts))]
    for kind in (OutputKind.FINAL_ONLY, OutputKind.DELTA):
        assert _run(engine, True, requests, kind) == _run(engine, False, requests, kind)
    assert engine.scheduler.num_accepted_tokens > 0
