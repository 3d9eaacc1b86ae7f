"""Disaggregated serving end to end: a prefill pool and a decode pool handing off KV blocks, over the
object store and over gloo, against the offline engine's greedy outputs (float32); and a replica of
either pool killed mid-hand-off."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest
from serving_helpers import http, metric_sum, scrape

from loadtest.recovery import kill_replica
from serving import LLM, SamplingParams
from serving.app_config import parse_app_args

MODEL = "SmolLM2-135M-Instruct"
PREFILL_BUDGET = 64
ENGINE = dict(dtype="float32", max_model_len=1024)
POOLS = dict(disaggregate=True, prefill_engine={"max_num_batched_tokens": PREFILL_BUDGET}, decode_engine={"max_num_seqs": 64},
             kv_lease_s=3, **ENGINE)


@pytest.fixture(scope="module")
def offline():
    return LLM(kv_cache_memory="256MiB", **ENGINE)


@pytest.fixture(scope="module", params=["object_store", "gloo"])
def app(request, deploy_app):
    from ray import serve

    name = f"dis-{request.param.replace('_', '')}"
    url = deploy_app(name, kv_transport=request.param, **POOLS)
    yield request.param, url
    serve.delete(name)  # before the other transport's app starts


def wait_all_free(url: str, timeout: float = 30.0) -> dict:
    """Metrics once every replica of both pools has no running request, no held KV and no used block."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = {name: metric_sum(m, name) for name in ("kvrelay:kv_cache_usage_perc", "kvrelay:num_requests_running",
                                                      "kvrelay:num_kv_held", "kvrelay:num_requests_waiting_for_kv")}
        if not any(busy.values()):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"blocks still in use after {timeout} s: {busy}")
        time.sleep(0.2)


def test_greedy_outputs_equal_colocated(app, offline, make_prompts):
    transport, url = app
    prompts = make_prompts([5, 17, 40, 64, 65, 100, 3 * PREFILL_BUDGET + 7, 300])  # two longer than the budget
    prompts.append(prompts[5][:80] + prompts[2][:20])  # shares 80 tokens (5 full blocks) with an earlier prompt
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    before = wait_all_free(url)
    served = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in prompts]
    expected = offline.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for resp, exp in zip(served, expected):
        assert resp.choices[0].text == exp.outputs[0].text
        assert resp.usage.completion_tokens == len(exp.outputs[0].token_ids)
    after = wait_all_free(url)
    sends = metric_sum(after, "kvrelay:kv_transfers_total", role="send", transport=transport) - \
        metric_sum(before, "kvrelay:kv_transfers_total", role="send", transport=transport)
    receives = metric_sum(after, "kvrelay:kv_transfers_total", role="receive", transport=transport) - \
        metric_sum(before, "kvrelay:kv_transfers_total", role="receive", transport=transport)
    assert sends == receives == len(prompts)
    hits = metric_sum(after, "kvrelay:prefix_cache_hits_total") - metric_sum(before, "kvrelay:prefix_cache_hits_total")
    assert hits >= 80
    assert metric_sum(after, "kvrelay:kv_lease_expired_total") == metric_sum(before, "kvrelay:kv_lease_expired_total")
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):  # once per request, not per pool
        name = f"kvrelay:{histogram}_count"
        assert metric_sum(after, name) - metric_sum(before, name) == len(prompts), histogram


def test_streaming_first_token_comes_from_prefill(app, offline):
    _, url = app
    prompt = "The three primary colors are"
    expected = offline.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == expected.text
    assert texts[0] == offline.tokenizer.decode(expected.token_ids[:1])
    assert chunks[-1].usage.completion_tokens == 10
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
    wait_all_free(url)


def test_aborts_before_and_during_transfer_free_everything(app):
    _, url = app

    async def read_then_close(session: aiohttp.ClientSession, i: int, events_wanted: int) -> None:
        body = {"model": MODEL, "prompt": f"Number {i} is", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = 0
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    events += 1
                    if events >= events_wanted:
                        break
            resp.close()

    async def run():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(read_then_close(session, i, 1 + i % 3) for i in range(12)))

    asyncio.run(run())
    wait_all_free(url, timeout=30)
    status, body = http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def faulty(deploy_app) -> str:
    """Decode replicas wait 5 s before they fetch KV: a window to kill a replica mid-hand-off."""
    return deploy_app("dis-kill", kv_transport="object_store", kv_fetch_delay_s=5, **POOLS)


def _kill_during_transfer(url: str, deployment: str) -> openai.APIStatusError:
    """Send one request, kill a replica of `deployment` once the decode side waits for the KV, and return
    the error the client got."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    async def run() -> openai.APIStatusError:
        task = asyncio.create_task(client.completions.create(model=MODEL, prompt="A long story:", max_tokens=50))
        deadline = time.monotonic() + 60
        while metric_sum(scrape(url), "kvrelay:num_requests_waiting_for_kv") < 1:  # the fetch has started
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        kill_replica("dis-kill", deployment)
        with pytest.raises(openai.APIStatusError) as error:
            await asyncio.wait_for(task, 60)  # an error, not a hang
        return error.value

    return asyncio.run(run())


def _wait_served(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while http("POST", f"{url}/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3}, timeout=60)[0] != 200:
        assert time.monotonic() < deadline, "the pools did not recover"
        time.sleep(1)


def test_decode_replica_killed_during_transfer(faulty):
    error = _kill_during_transfer(faulty, "DecodeWorker")
    assert error.status_code == 503 and "replica" in error.message
    deadline = time.monotonic() + 60
    while True:  # the prefill side frees the blocks by lease (3 s)
        m = scrape(faulty)
        if metric_sum(m, "kvrelay:num_kv_held") == 0 and metric_sum(m, "kvrelay:kv_cache_usage_perc") == 0 \
                and metric_sum(m, "kvrelay:kv_lease_expired_total") >= 1:
            break
        assert time.monotonic() < deadline, "the lease did not free the prefill blocks"
        time.sleep(0.5)
    _wait_served(faulty)


def test_prefill_replica_killed_during_transfer(faulty):
    _wait_served(faulty)
    error = _kill_during_transfer(faulty, "PrefillWorker")
    assert error.status_code == 503 and "KV" in error.message  # the decode replica could not fetch it
    wait_all_free(faulty)  # the decode side holds nothing for the lost request
    _wait_served(faulty)


@pytest.mark.parametrize("override, named", [({"block_size": 32}, "block_size 16 vs 32"),
                                             ({"dtype": "bfloat16"}, "dtype 'float32' vs 'bfloat16'")])
def test_mismatched_pools_are_refused_at_start(override, named):
    with pytest.raises(ValueError, match=named):
        parse_app_args({**POOLS, "decode_engine": override})
