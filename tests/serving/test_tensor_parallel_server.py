"""`kvrelay serve --tensor-parallel-size 2` end to end on a tiny random model (float32, gloo): the replica's
two ranks take the bundles of its placement group, greedy tokens over HTTP equal one process's, and a killed
rank ends the streams in flight with an error, new requests get 503 until Serve has replaced the replica,
and then it serves again. A TP-2 prefill pool hands its KV off to a TP-1 decode pool."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import ray
from serving_helpers import http, metric_sum, scrape

from serving import LLM, SamplingParams

MODEL = "tiny-tp"
ENGINE = dict(dtype="float32", num_threads=2, kv_cache_memory="16MiB")
PROMPTS = [[1, 5, 9, 200, 3000, 7], list(range(100, 140))]


@pytest.fixture(scope="module")
def url(deploy_app, tiny_model_dir):
    return deploy_app("tp", model=tiny_model_dir, served_model_name=MODEL, tensor_parallel_size=2,
                      replica_wait_timeout_s=3.0, **ENGINE)


def _rank_actors() -> list[tuple[str, str]]:
    """(name, namespace) of every live rank actor, by name."""
    return sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("kvrelay-tp-"))


def test_greedy_tokens_over_http_equal_one_process(url, tiny_model_dir):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in LLM(tiny_model_dir, **ENGINE).generate(PROMPTS, params)]
    for prompt, text in zip(PROMPTS, expected):
        status, body = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                              "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"] == text
    ranks = _rank_actors()
    assert len(ranks) == 2 and ranks[0][0].endswith("rank0") and ranks[1][0].endswith("rank1")


def test_a_killed_rank_ends_streams_with_an_error_and_the_replica_is_replaced(url):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    before = _rank_actors()

    async def stream_until_error(started: asyncio.Event) -> str:
        try:
            stream = await client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1000, stream=True,
                                                     extra_body={"ignore_eos": True})
            async for _ in stream:
                started.set()
        except openai.APIError as e:
            return f"error: {e}"
        return "finished"

    async def whole_answer() -> int:
        try:
            await client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=1000,
                                            extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            return e.status_code
        return 200

    async def run() -> tuple[str, int]:
        started = asyncio.Event()
        whole = asyncio.create_task(whole_answer())
        task = asyncio.create_task(stream_until_error(started))
        await asyncio.wait_for(started.wait(), 60)
        ray.kill(ray.get_actor(*before[1]))
        return await asyncio.wait_for(asyncio.gather(task, whole), 60)  # no hang

    outcome, status = asyncio.run(run())
    assert outcome.startswith("error"), outcome
    assert status >= 500, status  # the server's failure, not the request's
    deadline = time.monotonic() + 240
    while True:
        status, body = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2},
                            timeout=30)
        if status == 200:
            break
        assert status == 503, body  # the failing replica refuses, then none is ready until its successor is
        assert time.monotonic() < deadline, "the replica was not replaced in time"
        time.sleep(1.0)
    after = _rank_actors()
    assert len(after) == 2 and not set(after) & set(before)


def test_a_tp2_prefill_pool_hands_kv_off_to_a_tp1_decode_pool(deploy_app, tiny_model_dir):
    url = deploy_app("tppd", model=tiny_model_dir, served_model_name=MODEL, disaggregate=True,
                     prefill_engine={"tensor_parallel_size": 2}, **ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = LLM(tiny_model_dir, **ENGINE).generate(PROMPTS[1], params)[0].outputs[0].text
    before = scrape(url)
    status, body = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8,
                                                          "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["choices"][0]["text"] == expected, body
    after = scrape(url)
    for role in ("send", "receive"):
        moved = metric_sum(after, "kvrelay:kv_transfers_total", role=role) - \
            metric_sum(before, "kvrelay:kv_transfers_total", role=role)
        assert moved == 1, role
