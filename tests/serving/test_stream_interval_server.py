"""`kvrelay serve --stream-interval 4` end to end: a streamed completion or chat reply arrives as its first
token, then chunks of 4 tokens, then the rest with the finish reason; the text and the usage are those of the
same request unstreamed."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny-interval"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def client(deploy_app, tiny_model_dir):
    url = deploy_app("interval", model=tiny_model_dir, served_model_name=MODEL, dtype="float32", num_threads=1,
                     kv_cache_memory="16MiB", stream_interval=4)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


ARGS = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})


def test_a_streamed_completion_comes_in_chunks_of_the_interval(client):
    whole = client.completions.create(prompt=[1, 5, 9, 200, 3000, 7], **ARGS)
    chunks = list(client.completions.create(prompt=[1, 5, 9, 200, 3000, 7], stream=True,
                                            stream_options={"include_usage": True}, **ARGS))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert len(texts) == 4  # 1 token, 4, 4, then the last one with the finish reason
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == MAX_TOKENS


def test_a_streamed_chat_reply_comes_in_chunks_of_the_interval(client):
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(messages=messages, **ARGS)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **ARGS))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(contents) == whole.choices[0].message.content
    assert len(contents) <= 4  # not one per token (tokens that decode to no text add no chunk)
    assert chunks[-1].choices[0].finish_reason == "length"
