"""SamplingParams refuses every value the engine cannot hold, naming the field, and keeps the edges."""

from __future__ import annotations

import math

import pytest

from workers.sampling_params import (INT64_MAX, INT64_MIN, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N,
                                     MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams)


@pytest.mark.parametrize("kwargs, field", [
    ({"seed": 2**64}, "seed"),
    ({"seed": INT64_MAX + 1}, "seed"),
    ({"seed": INT64_MIN - 1}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"n": MAX_N + 1}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": INT64_MAX + 1}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": False}, "min_tokens"),
    ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": -math.inf}, "top_p"),
    ({"stop": 5}, "stop"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": ["3"]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"logit_bias": [(1, 2.0)]}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
    ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
])
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_edges_are_accepted():
    p = SamplingParams(n=MAX_N, seed=INT64_MAX, top_k=INT64_MAX, max_tokens=INT64_MAX, min_tokens=INT64_MAX,
                       logprobs=MAX_LOGPROBS, stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                       stop_token_ids=(0, INT64_MAX), temperature=0)
    assert p.stop_token_ids == [0, INT64_MAX] and len(p.stop_strings) == MAX_STOP_STRINGS
    assert SamplingParams(seed=INT64_MIN).seed == INT64_MIN
    assert SamplingParams(top_k=0).top_k == -1
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01, min_p=1, prompt_logprobs=0,
                       logit_bias={0: -100, 7: 100.0}, bad_words=("a b",))
    assert p.bad_words == ["a b"] and p.adjusts_logits
    assert not SamplingParams(min_p=0.5, bad_words=["x"]).adjusts_logits


def test_validate_catches_changes_after_construction():
    p = SamplingParams(seed=1)
    p.seed = 2**64
    with pytest.raises(ValueError, match="seed"):
        p.validate()
