"""The OpenAI-compatible server end to end: real Ray Serve, real HTTP, the official `openai` client, the
default model. float32 so greedy outputs are comparable token for token with the offline `LLM`."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import aiohttp
import jsonschema
import openai
import pytest
from serving_helpers import API_KEY, MAIN_APP_OPTIONS, http, metric_sum, scrape

from serving import LLM, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
BODY_LIMIT = MAIN_APP_OPTIONS["max_request_body_bytes"]
ENGINE = dict(dtype="float32", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def url(main_app_url):
    return main_app_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    return LLM(kv_cache_memory="256MiB", **ENGINE)


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """Metrics once nothing runs and the KV cache is empty (fails the test if that never happens)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if metric_sum(m, "kvrelay:kv_cache_usage_perc") == 0 and metric_sum(m, "kvrelay:num_requests_running") == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"server not idle after {timeout} s: kv usage {metric_sum(m, 'kvrelay:kv_cache_usage_perc')}")
        time.sleep(0.2)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "The three primary colors are"]


def test_models_and_health(url, client):
    assert http("GET", f"{url}/health")[0] == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completions_greedy_match_offline_engine(client, offline, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    def ask(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(ask, PROMPTS))
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))
    for prompt, resp, exp in zip(PROMPTS, served, expected):
        assert resp.choices[0].text == exp.outputs[0].text
        assert resp.choices[0].finish_reason == exp.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
        assert resp.usage.completion_tokens == len(exp.outputs[0].token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completions_batch_of_prompts_and_token_ids(client, offline, tokenizer):
    ids = tokenizer(PROMPTS[1]).input_ids
    resp = client.completions.create(model=MODEL, prompt=[ids, tokenizer(PROMPTS[2]).input_ids], max_tokens=8,
                                      temperature=0)
    expected = offline.generate([PROMPTS[1], PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0))
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [e.outputs[0].text for e in expected]
    assert resp.usage.prompt_tokens == len(ids) + len(tokenizer(PROMPTS[2]).input_ids)


def test_chat_greedy_streaming_and_not(client, offline):
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    expected = offline.chat(messages, SamplingParams(max_tokens=20, temperature=0))[0].outputs[0]
    prompt_len = len(offline.apply_chat_template(messages))
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == len(expected.token_ids)

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.prompt_tokens == prompt_len


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_n2_seed_and_stop(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, n=2, seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.text for c in resp.choices)
    again = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, n=2, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    assert resp.usage.completion_tokens == 24

    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0).choices[0].text
    word = greedy.split()[2]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == greedy[:greedy.index(word)]


def test_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert "".join(lp.tokens) == resp.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) >= 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy picks the most likely token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


async def _stream_tokens(url: str, prompt: str, max_tokens: int) -> tuple[int, int]:
    """Streams one completion with raw SSE; returns (usage.completion_tokens, tokens seen in logprobs)."""
    aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              logprobs=0, stream=True, stream_options={"include_usage": True})
    seen, usage = 0, None
    async for chunk in stream:
        if chunk.choices:
            seen += len(chunk.choices[0].logprobs.tokens)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    await aclient.close()
    return usage, seen


def test_32_concurrent_streams_and_metrics(url, corpus_ids, tokenizer):
    before = wait_idle(url)
    prompts = [tokenizer.decode(corpus_ids[i * 50:i * 50 + 20 + i]) for i in range(32)]

    async def run():
        return await asyncio.gather(*(_stream_tokens(url, p, 8 + i) for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    assert all(usage == seen and 0 < usage <= 8 + i for i, (usage, seen) in enumerate(results))
    after = wait_idle(url)
    received = sum(u for u, _ in results)
    generated = metric_sum(after, "kvrelay:generation_tokens_total") - metric_sum(before, "kvrelay:generation_tokens_total")
    assert generated == received
    finished = sum(metric_sum(after, "kvrelay:request_success_total", finished_reason=r)
                   - metric_sum(before, "kvrelay:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == 32
    ttft = metric_sum(after, "kvrelay:time_to_first_token_seconds_count") - metric_sum(before, "kvrelay:time_to_first_token_seconds_count")
    assert ttft == 32
    assert all(dict(lbls).get("replica") for (name, lbls) in after if name.startswith("kvrelay:"))


def test_client_disconnect_aborts(url):
    before = wait_idle(url)

    async def read_three_then_close(session: aiohttp.ClientSession, i: int) -> int:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "stream": True}
        events = 0
        async with session.post(f"{url}/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    events += 1
                    if events == 3:
                        break
            resp.close()  # drop the connection mid-stream
        return events

    async def run():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(read_three_then_close(session, i) for i in range(20)))

    assert asyncio.run(run()) == [3] * 20
    after = wait_idle(url, timeout=60)
    aborted = metric_sum(after, "kvrelay:request_success_total", finished_reason="abort") - \
        metric_sum(before, "kvrelay:request_success_total", finished_reason="abort")
    assert aborted == 20
    status, body = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                        {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


def _bad_requests(tokenizer) -> list[tuple[str, str, bytes | dict, dict, int]]:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    ok = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    long_prompt = [tokenizer.eos_token_id or 0] * (MAX_MODEL_LEN + 5)
    return [
        ("invalid JSON", "/v1/completions", b'{"model": "x", "prompt": ', {**auth, "Content-Type": "application/json"}, 400),
        ("max_tokens as a string", "/v1/completions", {**ok, "max_tokens": "4"}, auth, 400),
        ("prompt as a number", "/v1/completions", {**ok, "prompt": 42}, auth, 400),
        ("known field of the wrong type", "/v1/chat/completions", {**chat, "add_generation_prompt": 1}, auth, 400),
        ("image content part", "/v1/chat/completions",
         {**chat, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, auth, 400),
        ("untrusted request chat template", "/v1/chat/completions", {**chat, "chat_template": "{{ 1 }}"}, auth, 400),
        ("token id outside the vocabulary to detokenize", "/detokenize", {"model": MODEL, "tokens": [10**9]}, auth, 400),
        ("tokenize for an unknown model", "/tokenize", {"model": "gpt-5", "prompt": "x"}, auth, 404),
        ("tokenize without an API key", "/tokenize", {"model": MODEL, "prompt": "x"}, {}, 401),
        ("detokenize without an API key", "/detokenize", {"model": MODEL, "tokens": [1]}, {}, 401),
        ("missing prompt", "/v1/completions", {"model": MODEL}, auth, 400),
        ("max_tokens 0", "/v1/completions", {**ok, "max_tokens": 0}, auth, 400),
        ("temperature -1", "/v1/completions", {**ok, "temperature": -1}, auth, 400),
        ("top_p 2", "/v1/completions", {**ok, "top_p": 2}, auth, 400),
        ("n 0", "/v1/completions", {**ok, "n": 0}, auth, 400),
        ("huge n", "/v1/completions", {**ok, "n": 100000}, auth, 400),
        ("logprobs 50", "/v1/completions", {**ok, "logprobs": 50}, auth, 400),
        ("stream_options without stream", "/v1/completions", {**ok, "stream_options": {"include_usage": True}}, auth, 400),
        ("prompt beyond max_model_len", "/v1/completions", {**ok, "prompt": long_prompt}, auth, 400),
        ("prompt + max_tokens beyond max_model_len", "/v1/completions",
         {**ok, "prompt": long_prompt[:MAX_MODEL_LEN - 10], "max_tokens": 20}, auth, 400),
        ("token id outside the vocabulary", "/v1/completions", {**ok, "prompt": [1, 10**9]}, auth, 400),
        ("empty prompt list", "/v1/completions", {**ok, "prompt": []}, auth, 400),
        ("empty messages", "/v1/chat/completions", {**chat, "messages": []}, auth, 400),
        ("unknown message role", "/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}, auth, 400),
        ("top_logprobs without logprobs", "/v1/chat/completions", {**chat, "top_logprobs": 2}, auth, 400),
        ("invalid JSON schema", "/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, auth, 400),
        ("invalid guided_regex", "/v1/completions", {**ok, "guided_regex": "(a"}, auth, 400),
        ("tool_choice names no tool", "/v1/chat/completions", {**chat, "tools": [WEATHER_TOOL], "tool_choice": {
            "type": "function", "function": {"name": "nope"}}}, auth, 400),
        ("unknown model", "/v1/completions", {**ok, "model": "gpt-5"}, auth, 404),
        ("unknown route", "/v1/embeddings", {"model": MODEL, "input": "x"}, auth, 404),
        ("missing API key", "/v1/completions", ok, {}, 401),
        ("wrong API key", "/v1/completions", ok, {"Authorization": "Bearer nope"}, 401),
        ("oversized body", "/v1/completions", {**ok, "prompt": "x" * (BODY_LIMIT + 10)}, auth, 413),
        ("wrong content type", "/v1/completions", b"prompt=Hello", {**auth, "Content-Type": "text/plain"}, 415),
    ]


def test_bad_requests_get_openai_errors(url, tokenizer):
    before = wait_idle(url)
    cases = _bad_requests(tokenizer)
    assert len(cases) >= 15
    for name, path, body, headers, expected in cases:
        status, resp = http("POST", f"{url}{path}", body, headers)
        assert status == expected, f"{name}: got {status} {resp}"
        assert isinstance(resp, dict) and set(resp) == {"error"}, f"{name}: {resp}"
        err = resp["error"]
        assert isinstance(err["message"], str) and err["message"], name
        assert isinstance(err["type"], str) and {"param", "code"} <= set(err), name
    assert http("GET", f"{url}/health")[0] == 200  # open without a key
    assert http("GET", f"{url}/version")[0] == 200  # open without a key, as in vLLM
    assert http("GET", f"{url}/v1/models")[0] == 401
    status, body = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                        {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    after = wait_idle(url)
    assert metric_sum(after, "kvrelay:prompt_tokens_total") - metric_sum(before, "kvrelay:prompt_tokens_total") == \
        body["usage"]["prompt_tokens"]  # none of the bad requests reached the engine


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x")


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"], "additionalProperties": False}}}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_response_format_json_schema_and_guided_choice(client, offline):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    resp = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=40, temperature=0,
                                          response_format=fmt)
    jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
    assert resp.choices[0].finish_reason == "stop"
    choices = ["positive", "negative"]
    review = [{"role": "user", "content": "Is 'I loved it' positive or negative?"}]
    picked = client.chat.completions.create(model=MODEL, messages=review, max_tokens=8, temperature=0,
                                            extra_body={"guided_choice": choices})
    assert picked.choices[0].message.content in choices
    regex = client.completions.create(model=MODEL, prompt="The year was", max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"regex": " [12][0-9]{3}"}})
    assert re.fullmatch(" [12][0-9]{3}", regex.choices[0].text)


def test_bad_schema_is_400_naming_the_field(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema") as e:
        client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=4, response_format=fmt)
    assert e.value.body["param"] == "response_format.json_schema.schema"


def test_tool_choice_required_and_named_return_tool_calls(client):
    required = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                              tool_choice="required", max_tokens=40, temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])

    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice=named,
                                          max_tokens=30, temperature=0)
    call = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "stop" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])

    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                                 tool_choice=named, max_tokens=30, temperature=0, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    streamed = list(client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                                   tool_choice="required", max_tokens=40, temperature=0, stream=True))
    calls = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == \
        [(tc.function.name, tc.function.arguments) for tc in choice.message.tool_calls]
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_auto_and_none_answer(client):
    auto = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], max_tokens=12,
                                          temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="none",
                                          max_tokens=12, temperature=0)
    assert none.choices[0].message.content and not none.choices[0].message.tool_calls


def _runs_user_code_on_serves_loop(replica) -> tuple[bool, bool]:
    """In the replica's process: (Serve's setting, whether Serve made a second loop for the user code)."""
    from ray.serve._private import constants

    return constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, any(
        t.name.startswith("Thread-") and "_run_user_code_event_loop" in t.name for t in threading.enumerate())


def test_the_apps_replicas_run_their_code_on_serves_own_loop(url):
    """`SERVE_REPLICA_ENV` reaches the replicas: no second event loop, so a stream's chunks do not cross threads."""
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probe goes to the replica by value
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and "main#" in a["name"]]
    assert names
    for name in names:
        replica = ray.get_actor(name, namespace="serve")
        assert ray.get(replica.__ray_call__.remote(_runs_user_code_on_serves_loop), timeout=60) == (False, False), name
