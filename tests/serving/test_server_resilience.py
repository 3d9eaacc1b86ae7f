"""Overload, bad requests beside good ones, replica failure and autoscaling, each on its own small app in
the shared Ray cluster."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
import ray
from ray import serve
from serving_helpers import http, metric_sum, scrape

from loadtest.recovery import RecoveryRun, measure_recovery

MODEL = "SmolLM2-135M-Instruct"


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, float, str | None]:
    start = time.monotonic()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.json(), time.monotonic() - start, resp.headers.get("Retry-After")


@pytest.fixture(scope="module")
def queue_url(deploy_app):
    """A replica that admits only what can start at once: 4 sequences, none waiting."""
    return deploy_app("queue", max_waiting_requests=0, max_num_seqs=4)


def test_zero_waiting_serves_a_request_on_an_idle_server(queue_url):
    status, body = http("POST", f"{queue_url}/v1/completions", {"model": MODEL, "prompt": "One two three four five six",
                                                                "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_queue_full_refuses_fast(queue_url):
    url = queue_url
    body = {"model": MODEL, "prompt": "Count to one hundred:", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
    rejected_before = metric_sum(scrape(url), "kvrelay:num_requests_rejected_total", reason="queue_full")

    async def burst():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(_post(session, url, body) for _ in range(64)))

    results = asyncio.run(burst())
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == 64
    assert len(ok) >= 4 and len(refused) >= 32
    assert all(r[1]["usage"]["completion_tokens"] == 32 for r in ok)
    assert all(r[1]["error"]["type"] == "server_overloaded" and "waiting" in r[1]["error"]["message"] for r in refused)
    assert all(r[3] == "1" for r in refused)  # Retry-After, in seconds
    slowest_ok = max(r[2] for r in ok)
    assert max(r[2] for r in refused) < slowest_ok  # refusals do not wait for the work in front of them
    m = scrape(url)
    assert metric_sum(m, "kvrelay:kv_cache_usage_perc") == 0
    assert metric_sum(m, "kvrelay:num_requests_rejected_total", reason="queue_full") - rejected_before == len(refused)


def test_prompts_and_sequences_per_request_are_capped(queue_url):
    status, body = http("POST", f"{queue_url}/v1/completions", {"model": MODEL, "prompt": ["Hi"] * 1025, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt" and "1,025" in body["error"]["message"]
    status, body = http("POST", f"{queue_url}/v1/completions", {"model": MODEL, "prompt": ["Hi"] * 9, "n": 128,
                                                                "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "n" and "1,152 sequences" in body["error"]["message"]


def test_numbers_the_engine_cannot_hold_get_400_and_spare_a_running_stream(queue_url):
    url = queue_url  # the stream and the refused requests fit its 4 sequences
    good = {"model": MODEL, "prompt": "Count to fifty:", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "stream": True}
    bad = [("seed", 2**64), ("seed", -2**63 - 1), ("top_k", 2**63)]

    async def run():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/completions", json=good) as resp:
                events = [await resp.content.readline()]
                refused = await asyncio.gather(*(
                    _post(session, url, {"model": MODEL, "prompt": "Hi", "max_tokens": 4, field: value})
                    for field, value in bad))
                events += [line async for line in resp.content]
                return resp.status, refused, [e.decode().strip() for e in events if e.strip()]

    status, refused, events = asyncio.run(run())
    for (field, _), (code, body, *_) in zip(bad, refused):
        assert code == 400 and body["error"]["param"] == field and field in body["error"]["message"], body
    assert status == 200 and events[-1] == "data: [DONE]" and not any('"error":' in e for e in events), events[-3:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert metric_sum(scrape(url), "kvrelay:kv_cache_usage_perc") == 0


def _replica_actors(app: str, deployment: str) -> list:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and f"{app}#{deployment}#" in a["name"]]
    return [ray.get_actor(n, namespace="serve") for n in names]


WAIT_S = 3.0  # replica_wait_timeout_s of the apps below


@pytest.mark.parametrize("in_ingress", [False, True], ids=["engine-replica", "engine-in-ingress"])
def test_killed_replica_ends_streams_with_error_and_recovers(deploy_app, in_ingress):
    app = "kill-fused" if in_ingress else "kill"
    deployment = "OpenAIIngress" if in_ingress else "EngineWorker"
    url = deploy_app(app, replica_wait_timeout_s=WAIT_S, engine_in_ingress=in_ingress)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    async def stream_until_error(i: int, started: asyncio.Event) -> str:
        try:
            stream = await client.completions.create(model=MODEL, prompt=f"Tale {i}:", max_tokens=1000,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                started.set()
        except openai.APIError as e:
            return f"error: {e}"
        return "finished"

    async def run() -> tuple[list[str], RecoveryRun]:
        started = asyncio.Event()
        tasks = [asyncio.create_task(stream_until_error(i, started)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(0.5)
        assert len(_replica_actors(app, deployment)) == 1
        recovery = asyncio.create_task(measure_recovery(url, app, MODEL, probe_interval_s=1.0))
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)  # no hang
        return outcomes, await recovery

    outcomes, recovery = asyncio.run(run())
    assert all(o.startswith("error") for o in outcomes), outcomes  # cut with an error event, or the connection
    assert recovery.served_s is not None, recovery.to_dict()
    if in_ingress:  # nothing of the app is left to answer 503: Serve's proxy holds requests for the replacement
        assert all(p.status == 200 and p.done_s < recovery.served_s + 5 for p in recovery.probes), recovery.to_dict()
    # during the gap, with an engine replica: 503 with a body, within the bound; never silence
    for probe in ([] if in_ingress else recovery.probes):
        assert probe.status in (200, 503), probe
        assert probe.done_s - probe.sent_s < WAIT_S + 10, probe
        if probe.status == 503:
            assert "replica" in probe.error, probe
    assert recovery.process_started_s is not None and recovery.process_started_s < recovery.served_s


async def _sse(session: aiohttp.ClientSession, url: str, body: dict, started: asyncio.Event) -> tuple[list[dict], float]:
    """The data events of one streamed completion (error events included) and when `[DONE]` came."""
    events: list[dict] = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return events, time.monotonic()
            events.append(json.loads(data))
            started.set()
    raise AssertionError(f"the stream was cut without [DONE] after {len(events)} events: {events[-1:]}")


def test_redeploy_lets_a_short_stream_finish_and_ends_a_long_one_with_an_error(deploy_app):
    drain_s, options = 8.0, dict(drain_timeout_s=8, replica_wait_timeout_s=WAIT_S)
    url = deploy_app("drain", **options)
    body = {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            started = [asyncio.Event(), asyncio.Event()]
            # short: done well within the drain even where two streams decode at ~10 tok/s each (float32 on an
            # AVX2-only CPU, beside the new replica's start)
            short = asyncio.create_task(_sse(session, url, {**body, "max_tokens": 16}, started[0]))
            long = asyncio.create_task(_sse(session, url, {**body, "max_tokens": 4000}, started[1]))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            start = time.monotonic()
            redeploy = asyncio.create_task(asyncio.to_thread(deploy_app, "drain", **options, max_num_seqs=255))
            (short_events, short_end), (long_events, long_end) = await asyncio.gather(short, long)
            await redeploy
            return short_events, short_end - start, long_events, long_end - start

    try:
        short_events, short_s, long_events, long_s = asyncio.run(run())
    finally:
        serve.delete("drain")
    assert short_s > 0 and all("error" not in e for e in short_events)
    assert short_events[-1]["usage"]["completion_tokens"] == 16  # finished on the stopping replica
    assert "error" in long_events[-1] and "shutting down" in long_events[-1]["error"]["message"], long_events[-1]
    assert drain_s - 1 < long_s < drain_s + 15


def test_autoscaling_adds_a_replica_that_serves(deploy_app):
    # a small KV cache: its second replica starts beside the module's other apps (in float32, on a CPU without
    # oneDNN's bfloat16, Ray's memory monitor once killed a replica of 512 MiB of KV late in a full run)
    url = deploy_app("scale", min_replicas=1, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=1,
                     look_back_period_s=2, metrics_interval_s=0.5, downscale_delay_s=600, max_model_len=1024,
                     kv_cache_memory="64MiB")

    def replicas_running() -> int:
        dep = serve.status().applications["scale"].deployments["EngineWorker"]
        return dep.replica_states.get("RUNNING", 0)

    assert replicas_running() == 1
    body = {"model": MODEL, "prompt": "Write a long essay about rivers.", "max_tokens": 16, "ignore_eos": True}

    async def sustained_load():
        async with aiohttp.ClientSession() as session:
            pending: set[asyncio.Task] = set()
            deadline = time.monotonic() + 240
            while replicas_running() < 2:
                assert time.monotonic() < deadline, "did not scale up"
                while len(pending) < 8:
                    pending.add(asyncio.create_task(_post(session, url, body)))
                done, pending = await asyncio.wait(pending, timeout=1.0)
                assert all(t.result()[0] == 200 for t in done), [t.result()[:2] for t in done if t.result()[0] != 200]
            # both replicas take the next burst
            more = [asyncio.create_task(_post(session, url, body)) for _ in range(8)]
            results = await asyncio.gather(*pending, *more)
            assert all(r[0] == 200 for r in results), [r[:2] for r in results if r[0] != 200]

    asyncio.run(sustained_load())
    assert replicas_running() == 2
    m = scrape(url)
    per_replica = {dict(lbls)["replica"]: v for (name, lbls), v in m.items() if name == "kvrelay:generation_tokens_total"}
    assert len(per_replica) == 2 and all(v > 0 for v in per_replica.values()), per_replica
