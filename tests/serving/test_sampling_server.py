"""vLLM's sampling fields through the server with the official `openai` client (on the shared default-model
app): penalties, logit bias, bad words, min_p, special tokens, stop strings kept, prompt logprobs, echo
(lm-eval-harness's loglikelihood payload among them), and 400s that name the field."""

from __future__ import annotations

import openai
import pytest
from serving_helpers import API_KEY, http

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(main_app_url):
    return openai.OpenAI(base_url=f"{main_app_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _complete(client, **kw):
    return client.completions.create(model=MODEL, prompt=kw.pop("prompt", PROMPT), temperature=0,
                                     max_tokens=kw.pop("max_tokens", 8), **kw)


def test_logit_bias_and_special_tokens_on_both_endpoints(client, tokenizer):
    forced = _complete(client, max_tokens=3, logit_bias={"4301": 100})
    assert forced.choices[0].text == tokenizer.decode([4301] * 3)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=3, logit_bias={"1": 100},
                                          extra_body={"skip_special_tokens": False, "ignore_eos": True,
                                                      "spaces_between_special_tokens": False})
    assert chat.choices[0].message.content == "<|im_start|>" * 3
    skipped = _complete(client, max_tokens=3, logit_bias={"1": 100}, extra_body={"ignore_eos": True})
    assert skipped.choices[0].text == ""


def test_penalties_min_p_bad_words_and_stop_strings(client):
    repeat = "one one one one one one one one"
    plain = _complete(client, prompt=repeat).choices[0].text
    assert _complete(client, prompt=repeat, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text != plain
    assert _complete(client, prompt=repeat, extra_body={"repetition_penalty": 3.0}).choices[0].text != plain
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": repeat}], temperature=0,
                                          max_tokens=8, presence_penalty=-2.0, frequency_penalty=1.0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    greedy = _complete(client).choices[0].text
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                        extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == greedy
    first_word = greedy.split()[0]
    banned = _complete(client, extra_body={"bad_words": [first_word]}).choices[0].text
    assert banned.split()[0] != first_word
    stop = greedy[2:5]
    kept = _complete(client, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text.endswith(stop) and kept.finish_reason == "stop" and kept.text == greedy[:greedy.index(stop) + 3]


def test_prompt_logprobs_on_both_endpoints(client, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    resp = _complete(client, max_tokens=2, extra_body={"prompt_logprobs": 2})
    lps = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    for token, entry in zip(ids[1:], lps[1:]):
        assert str(token) in entry and len([v for v in entry.values() if v["rank"] <= 2]) == 2
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


def test_lm_eval_loglikelihood_payload(main_app_url, tokenizer):
    """lm-eval-harness `local-completions` loglikelihood: tokenized prompts, echo, logprobs=1, max_tokens=1."""
    contexts = [tokenizer("Question: What is 2 + 2? Answer:").input_ids, tokenizer(PROMPT).input_ids]
    conts = [tokenizer(" 4").input_ids, tokenizer(" Paris").input_ids]
    prompts = [c + x for c, x in zip(contexts, conts)]
    payload = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    status, body = http("POST", f"{main_app_url}/v1/completions", payload, AUTH)
    assert status == 200, body
    choices = sorted(body["choices"], key=lambda c: c["index"])
    for choice, ids, ctx in zip(choices, prompts, contexts):
        lp = choice["logprobs"]
        assert choice["text"].startswith(tokenizer.decode(ids))
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and all(t is not None for t in lp["top_logprobs"][1:])
        prompt_lps = choice["prompt_logprobs"]
        for pos in range(1, len(ids)):
            assert lp["token_logprobs"][pos] == pytest.approx(prompt_lps[pos][str(ids[pos])]["logprob"])
        continuation = lp["token_logprobs"][len(ctx):-1]
        assert len(continuation) == len(ids) - len(ctx) and all(v <= 0 for v in continuation)
        for tok, top in zip(continuation, lp["top_logprobs"][len(ctx):-1]):
            assert max(top.values()) >= tok  # lm-eval's is_greedy check reads these
    alone = http("POST", f"{main_app_url}/v1/completions", {**payload, "prompt": prompts[0], "echo": False}, AUTH)[1]
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        choices[0]["logprobs"]["token_logprobs"][-1:], abs=1e-4)


def test_echo_without_generation_without_logprobs_and_streaming(client, tokenizer):
    only = _complete(client, max_tokens=0, echo=True, logprobs=0)
    n = len(tokenizer(PROMPT).input_ids)
    assert only.choices[0].text == PROMPT and len(only.choices[0].logprobs.tokens) == n
    assert "".join(only.choices[0].logprobs.tokens) == PROMPT and only.usage.completion_tokens == 0
    greedy = _complete(client).choices[0].text
    echoed = _complete(client, echo=True)
    assert echoed.choices[0].text == PROMPT + greedy and echoed.choices[0].logprobs is None
    streamed = "".join(c.choices[0].text for c in _complete(client, echo=True, stream=True, logprobs=1) if c.choices)
    assert streamed == PROMPT + greedy


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("min_p", 1.5),
    ("logit_bias", {"99999999": 1}), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("bad_words", [""]),
    ("prompt_logprobs", 21), ("logprobs", 21), ("suffix", "!"), ("max_tokens", 0), ("skip_special_tokens", "no"),
    ("include_stop_str_in_output", 1), ("spaces_between_special_tokens", None), ("echo", "yes"),
])
def test_bad_values_get_400_naming_the_field(main_app_url, field, value):
    status, body = http("POST", f"{main_app_url}/v1/completions", {"model": MODEL, "prompt": "Hi", field: value}, AUTH)
    assert status == 400, body
    assert field in body["error"]["message"] and (body["error"]["param"] or "").startswith(field)
