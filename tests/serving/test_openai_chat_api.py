"""vLLM's request surface on a real server: the chat options through the official `openai` client
(`extra_body`), `/tokenize`, `/detokenize` and `/version` over plain HTTP, model name aliases, a server
chat template, and the exact requests `vllm bench serve` sends. Authentication is tested in
test_openai_server.py; this app runs without an API key, as `vllm bench serve` expects."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json

import aiohttp
import openai
import pytest
from serving_helpers import http

from serving.chat import ChatTemplateOptions, chat_prompt_ids

NAME, ALIAS = "smol", "smol-alias"
MAX_MODEL_LEN = 1024
# The tokenizer's ChatML without its default system prompt, and with message names: visibly not the tokenizer's.
SERVER_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}"
                   "{{ '\\n' }}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% endif %}")
REQUEST_TEMPLATE = "{% for m in messages %}{{ m.role }}{{ sep }}{{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def url(deploy_app, tmp_path_factory):
    template = tmp_path_factory.mktemp("templates") / "chatml.jinja"
    template.write_text(SERVER_TEMPLATE)
    return deploy_app("chatapi", served_model_name=[NAME, ALIAS], chat_template=str(template),
                      trust_request_chat_template=True, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def served_ids(tokenizer, messages, **options) -> list[int]:
    """The prompt the server should build: the server's template unless the options name another."""
    return chat_prompt_ids(tokenizer, messages, ChatTemplateOptions(**{"chat_template": SERVER_TEMPLATE, **options}))


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    return http("POST", f"{url}{path}", body)


def test_models_list_every_alias_and_responses_report_the_first(client, default_model_dir):
    cards = client.models.list().data
    assert [c.id for c in cards] == [NAME, ALIAS]
    assert all(c.root == default_model_dir and c.max_model_len == MAX_MODEL_LEN for c in cards)
    resp = client.completions.create(model=ALIAS, prompt="Hello", max_tokens=1)
    assert resp.model == NAME
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=1)


def test_tokenize_detokenize_and_version(url, tokenizer):
    text = "The capital of France is Paris."
    status, body = post(url, "/tokenize", {"model": ALIAS, "prompt": text, "return_token_strs": True})
    assert status == 200 and body["tokens"] == tokenizer(text).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    status, body = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})  # model is optional
    assert status == 200 and body["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    assert body["token_strs"] is None

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ann"}]
    status, body = post(url, "/tokenize", {"model": NAME, "messages": messages})
    assert status == 200 and body["tokens"] == served_ids(tokenizer, messages)
    assert "user (ann)" in tokenizer.decode(body["tokens"])  # the server's template, with the name
    cont = messages + [{"role": "assistant", "content": "Hello"}]
    status, body = post(url, "/tokenize", {"messages": cont, "add_generation_prompt": False,
                                           "continue_final_message": True})
    assert tokenizer.decode(body["tokens"]).endswith("assistant\nHello")
    status, body = post(url, "/tokenize", {"messages": messages, "chat_template": REQUEST_TEMPLATE,
                                           "chat_template_kwargs": {"sep": ": "}})
    assert status == 200 and tokenizer.decode(body["tokens"]) == "system: Be brief.\nuser: Hi\n"
    status, body = post(url, "/tokenize", {"messages": messages, "continue_final_message": True})
    assert status == 400 and body["error"]["param"] == "continue_final_message"

    ids = tokenizer(text).input_ids
    assert post(url, "/detokenize", {"model": NAME, "tokens": ids}) == (200, {"prompt": tokenizer.decode(ids)})
    status, body = post(url, "/detokenize", {"model": NAME, "tokens": [1, 10**9]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert http("GET", f"{url}/version") == (200, {"version": importlib.metadata.version("kvrelay")})


def test_chat_content_parts_names_tools_and_template_options(client, tokenizer):
    joined = [{"role": "user", "content": "Name a fruit.\nOne word."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a fruit."}, {"type": "text", "text": "One word."}]}]
    a = client.chat.completions.create(model=NAME, messages=joined, max_tokens=4, temperature=0)
    b = client.chat.completions.create(model=ALIAS, messages=parts, max_tokens=4, temperature=0)
    assert b.choices[0].message.content == a.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(served_ids(tokenizer, joined))
    assert b.model == NAME

    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    tools_chat = [{"role": "user", "content": "Weather in Paris?", "name": "ann"},
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    resp = client.chat.completions.create(model=NAME, messages=tools_chat, tools=tools, max_tokens=1)
    assert resp.usage.prompt_tokens == len(served_ids(tokenizer, tools_chat))

    # max_completion_tokens wins over max_tokens, as in vLLM
    resp = client.chat.completions.create(model=NAME, messages=joined, max_tokens=6, max_completion_tokens=2,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2 and len(resp.choices[0].logprobs.content) == 2
    cont = joined + [{"role": "assistant", "content": "The fruit is"}]
    resp = client.chat.completions.create(model=NAME, messages=cont, max_tokens=1, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "frobnicate": 1, "guided_json": {}})
    assert resp.usage.prompt_tokens == len(served_ids(tokenizer, cont, add_generation_prompt=False,
                                                      continue_final_message=True))


@pytest.mark.parametrize("messages, extra, param", [
    ([{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}],
     {}, "messages.0.content.1.type"),
    ([{"role": "user", "content": "x"}], {"continue_final_message": True}, "continue_final_message"),
    ([{"role": "user", "content": "x"}], {"add_generation_prompt": "no"}, "add_generation_prompt"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ([{"role": "user", "content": "x"}], {"chat_template": "{{ raise_exception('nope') }}"}, "chat_template"),
])
def test_chat_errors_name_the_field(client, messages, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, extra_body=extra)
    assert e.value.param == param


def test_the_requests_vllm_bench_serve_sends(url, tokenizer):
    """vllm/benchmarks/serve.py and lib/endpoint_request_func.py, request for request: the first model
    from /v1/models, prompt alignment through /tokenize and /detokenize, then streamed completions and
    chat completions with the payloads it builds (fields we do not implement included)."""
    prompt = "Once upon a time, in a land far away, there lived"

    async def run() -> list:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/v1/models") as r:
                r.raise_for_status()
                data = (await r.json())["data"]
            model_id, root = data[0]["id"], data[0]["root"]
            async with session.post(f"{url}/tokenize", json={"model": model_id, "prompt": prompt,
                                                              "add_special_tokens": False}) as r:
                r.raise_for_status()
                tokens = (await r.json())["tokens"]
            async with session.post(f"{url}/detokenize", json={"model": model_id, "tokens": tokens[:5]}) as r:
                r.raise_for_status()
                short = (await r.json())["prompt"]
            completion = {"model": model_id, "prompt": short, "repetition_penalty": 1.0, "max_tokens": 3,
                          "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                          "ignore_eos": True}
            chat = {"model": model_id, "messages": [{"role": "user", "content": [{"type": "text", "text": short}]}],
                    "max_completion_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True}
            usages = []
            for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                async with session.post(f"{url}{path}", json=body,
                                        headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200, await r.text()
                    events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: {")]
                    usages.append(json.loads(events[-1])["usage"])
            return [model_id, root, tokens, short, usages]

    model_id, root, tokens, short, usages = asyncio.run(run())
    assert model_id == NAME and root
    assert tokens == tokenizer(prompt, add_special_tokens=False).input_ids
    assert short == tokenizer.decode(tokens[:5])
    assert usages[0]["prompt_tokens"] == len(tokenizer(short).input_ids)
    assert [u["completion_tokens"] for u in usages] == [3, 3]
