"""Structured outputs: specs are validated and compiled once, matchers follow each sequence (and replay
after recompute), the sampler masks only constrained rows, and the real default model's greedy outputs
parse as JSON valid against their schema, match their regex, or are one of their choices."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from serving import LLM, SamplingParams, StructuredOutputsParams
from workers.request import Request
from workers.sampler import RowBitmask, apply_token_bitmask, sample
from workers.structured_output import StructuredOutputManager, choice_grammar, validate_structured_outputs

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,8} \d{2}"
CHOICES = ["positive", "negative", "neutral"]


def _so(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(**kw))


# ---- specs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    ({}, "exactly one of"),
    ({"json": PERSON, "regex": "a+"}, "json, regex"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON schema"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"json_object": False}, "json_object must be true"),
])
def test_params_need_one_well_typed_constraint(kw, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kw)


@pytest.mark.parametrize("kw, match", [
    ({"json": {"type": "objectx"}}, r"structured_outputs\.json is not a valid JSON schema: .*objectx"),
    ({"regex": "(abc"}, r"structured_outputs\.regex is not a valid regex: .*parenthesis"),
    ({"grammar": "root ::= undefined_rule"}, r"structured_outputs\.grammar is not a valid EBNF grammar: .*undefined_rule"),
])
def test_invalid_specs_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        validate_structured_outputs(StructuredOutputsParams(**kw))


def test_choice_grammar_escapes_quotes_and_backslashes():
    import xgrammar as xgr

    choices = ['say "hi"', "back\\slash", "naïve\nline"]
    xgr.Grammar.from_ebnf(choice_grammar(choices))  # parses


# ---- the manager, with the real tokenizer -----------------------------------------------------------


@pytest.fixture(scope="module")
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, len(tokenizer), max_rows=8, cache_size=2)


def _request(rid: str, tokenizer, params: SamplingParams, output: str = "") -> Request:
    prompt = tokenizer("Answer:").input_ids
    req = Request(rid, prompt, params, 50, eos_token_id=tokenizer.eos_token_id)
    req.all_token_ids += tokenizer(output, add_special_tokens=False).input_ids
    return req


def _allowed(bitmask: RowBitmask, row: int, vocab: int) -> set[int]:
    logits = apply_token_bitmask(torch.zeros(len(bitmask.rows), vocab), RowBitmask(torch.arange(len(bitmask.rows)),
                                                                                bitmask.bits))
    return set(torch.nonzero(logits[row] == 0).flatten().tolist())


def test_each_spec_compiles_once_in_an_lru_cache(manager):
    before = manager.num_compiled
    a = manager.compile(StructuredOutputsParams(json=PERSON))
    assert manager.compile(StructuredOutputsParams(json=json.dumps(PERSON))) is a  # same schema, other spelling
    assert manager.num_compiled == before + 1
    manager.compile(StructuredOutputsParams(regex="a+"))
    manager.compile(StructuredOutputsParams(regex="b+"))  # evicts the schema (cache_size=2)
    assert manager.compile(StructuredOutputsParams(json=PERSON)) is not a
    assert manager.num_compiled == before + 4
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        manager.compile(StructuredOutputsParams(regex="[z-a]"))


def test_bitmask_covers_constrained_rows_only_and_matchers_end_on_eos(manager, tokenizer):
    vocab = len(tokenizer)
    free = _request("free", tokenizer, SamplingParams())
    choice = _request("choice", tokenizer, _so(choice=CHOICES))
    manager.add([choice], manager.compile(choice.sampling_params.structured_outputs))
    mask = manager.bitmask([free, choice])
    assert mask.rows.tolist() == [1]
    first = _allowed(mask, 0, vocab)
    assert tokenizer.eos_token_id not in first
    assert all(any(c.startswith(tokenizer.decode([t])) for c in CHOICES) for t in first)
    for token in tokenizer("neutral", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]:
        assert not manager.accept([choice])[0]
        choice.append_token(token)
    ended, refused = manager.accept([free, choice])
    assert ended == [choice] and not refused
    manager.release(["choice"])
    assert not manager.active


def test_a_fresh_matcher_replays_the_known_output_tokens(manager, tokenizer):
    """After a recompute the request's tokens are known: a matcher that has seen none of them catches up
    and allows exactly what one fed token by token allows."""
    vocab = len(tokenizer)
    params = _so(json=PERSON)
    grammar = manager.compile(params.structured_outputs)
    stepwise = _request("stepwise", tokenizer, params)
    manager.add([stepwise], grammar)
    for token in tokenizer('{"name": "Ada", "age', add_special_tokens=False).input_ids:
        manager.bitmask([stepwise])
        stepwise.append_token(token)
        assert manager.accept([stepwise]) == ([], {})
    replayed = _request("replayed", tokenizer, params, '{"name": "Ada", "age')
    manager.add([replayed], grammar)
    mask = manager.bitmask([stepwise, replayed])
    assert _allowed(mask, 0, vocab) == _allowed(mask, 1, vocab)
    assert tokenizer.encode('"', add_special_tokens=False)[0] in _allowed(mask, 0, vocab)
    bad = _request("bad", tokenizer, params, "hello")
    manager.add([bad], grammar)
    assert bad in manager.accept([bad])[1]
    manager.release(["stepwise", "replayed", "bad"])


def test_sampler_masks_listed_rows_and_reports_raw_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    bits = torch.zeros(1, 3, dtype=torch.int32)
    bits[0, 2] = 1 << 3  # row 1 may take token 67 only
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=1)] * 3, [None] * 3,
                 allowed=RowBitmask(torch.tensor([1]), bits))
    assert out.token_ids == [int(logits[0].argmax()), 67, int(logits[2].argmax())]
    raw = logits.log_softmax(-1)
    assert out.logprobs[1][0] == pytest.approx(float(raw[1, 67]), abs=1e-5)
    masked = apply_token_bitmask(logits, RowBitmask(torch.tensor([1]), bits))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.isinf(masked[1]).sum() == 69


# ---- through the engine, on the real default model --------------------------------------------------


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, dtype="float32", max_model_len=512, kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def prompts(llm):
    asks = ["Describe a person as JSON with a name and an age.", "Write a first name and a two-digit number.",
            "Is this review positive or negative? 'I loved every minute of it.'",
            'Return exactly this JSON and nothing else: {"ok": true}',
            "Answer yes or no: is the sky blue?"]
    return [llm.apply_chat_template([{"role": "user", "content": a}]) for a in asks]


SPECS = [dict(json=PERSON), dict(regex=REGEX), dict(choice=CHOICES), dict(json_object=True),
         dict(grammar='root ::= ("yes" | "no") "."')]


def _check(spec: dict, text: str) -> None:
    if "json" in spec:
        jsonschema.validate(json.loads(text), spec["json"])
    elif "json_object" in spec:
        assert isinstance(json.loads(text), dict)
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    elif "choice" in spec:
        assert text in spec["choice"]
    else:
        assert text in ("yes.", "no."), text


@pytest.fixture(scope="module")
def constrained(llm, prompts):
    return llm.generate(prompts, [_so(**s) for s in SPECS])


def test_greedy_outputs_follow_their_spec_and_stop(llm, constrained):
    for spec, out in zip(SPECS, constrained):
        c = out.outputs[0]
        _check(spec, c.text)
        assert c.finish_reason == "stop", (spec, c.text)
        assert c.token_ids[-1] == llm.engine.eos_token_id
    assert not llm.engine.structured.active  # every matcher freed


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(llm, prompts):
    free = [SamplingParams(max_tokens=12, temperature=0.0),
            SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)]
    alone = llm.generate(prompts[:2], free)
    mixed = llm.generate(prompts[:2] + prompts, free + [_so(**s) for s in SPECS])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    for spec, out in zip(SPECS, mixed[2:]):
        _check(spec, out.outputs[0].text)


def test_preempted_requests_replay_their_grammar(default_model_dir, prompts, constrained):
    small = LLM(default_model_dir, dtype="float32", max_model_len=128, num_kv_blocks=8, block_size=16)
    outs = small.generate(prompts, [_so(**s) for s in SPECS])
    assert small.engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in constrained]


def test_sampled_n2_and_ignore_eos_follow_the_grammar(llm, prompts):
    params = SamplingParams(n=2, max_tokens=60, temperature=1.0, seed=3, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    out = llm.generate(prompts[0], params)[0]
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), PERSON)
        assert c.finish_reason == "stop"  # the grammar ended it, although EOS alone would not have


def test_invalid_spec_is_refused_at_add_request(llm):
    engine = llm.engine
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objectx"}))
    with pytest.raises(ValueError, match="structured_outputs.json"):
        engine.add_request("bad-schema", "hi", params)
    assert not engine.has_unfinished_requests() and not engine.structured.active
