"""`kvrelay bench soak`: how the client sorts outcomes (against a fake OpenAI server), the summary arithmetic
and checks, reading `/metrics` and /proc, and one short soak against a real server on the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from loadtest import bench
from loadtest.http_client import RequestResult
from loadtest.soak import serve_app_of
from loadtest.soak_client import Outcome, SoakResult, run_soak_load
from loadtest.soak_mix import SoakMix, SoakRequest, soak_requests
from loadtest.soak_probe import ServerState, cpu_seconds, engine_replica_pids, parse_server_state, rss_bytes
from loadtest.soak_report import RssReport, checks, counter_delta, failed, summarize_soak

TOKENS = list(range(1000, 6000))


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


@pytest.mark.parametrize("argv, needle", [
    (["soak", "--concurrency", "0"], "--concurrency must be >= 1"),
    (["soak", "--disconnect-fraction", "2"], "disconnect_share must be in [0, 1]"),
])
def test_bad_soak_command_lines_fail_clearly(argv: list[str], needle: str, capsys) -> None:
    assert bench.main(argv) == 2
    assert needle in capsys.readouterr().err


class FakeOpenAI:
    """Both endpoints, every path prefix a behaviour: "" answers well (streamed chunks 5 ms apart), /bad 503,
    /hang never answers, /cut breaks streams after one chunk and drops plain requests before any status."""

    def __init__(self) -> None:
        self.in_flight = self.max_in_flight = self.client_gone = 0
        self.app = web.Application()
        for prefix in ("", "/bad", "/hang", "/cut"):
            for path in ("/v1/completions", "/v1/chat/completions"):
                self.app.router.add_post(prefix + path, self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body, mode = await request.json(), request.path.split("/v1/")[0]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if mode == "/bad":
                await asyncio.sleep(0.02)
                return web.json_response({"error": {"message": "overloaded", "type": "x"}}, status=503)
            if mode == "/hang":
                await asyncio.sleep(3600)
            chat, n, k = "messages" in body, body["n"], body["max_tokens"]
            if not body["stream"]:
                if mode == "/cut":
                    request.transport.close()
                    return web.Response()
                choice = {"message": {"content": "x" * k}} if chat else {"text": "x" * k}
                return web.json_response({"choices": [{"index": i, "finish_reason": "length", "logprobs": {}, **choice}
                                                      for i in range(n)], "usage": {"completion_tokens": n * k}})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for step in range(k):
                    await asyncio.sleep(0.005)
                    for i in range(n):
                        delta = {"delta": {"content": "x"}} if chat else {"text": "x"}
                        end = "length" if step == k - 1 else None
                        await resp.write(f"data: {json.dumps({'choices': [{'index': i, 'finish_reason': end, **delta}]})}\n\n".encode())
                    if mode == "/cut":
                        request.transport.close()
                        return resp
                await resp.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n * k}})}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
            except (ConnectionError, RuntimeError):
                self.client_gone += 1
            return resp
        finally:
            self.in_flight -= 1


@asynccontextmanager
async def fake_openai() -> AsyncIterator[tuple[FakeOpenAI, str]]:
    server = FakeOpenAI()
    runner = web.AppRunner(server.app, handle_signals=False, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield server, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def soak_against(prefix: str, reqs: list[SoakRequest], timeout_s: float = 10.0) -> tuple[list[SoakResult], FakeOpenAI]:
    async def main() -> tuple[list[SoakResult], FakeOpenAI]:
        async with fake_openai() as (server, url):
            results, _ = await run_soak_load(url + prefix, "m", reqs, concurrency=4, timeout_s=timeout_s, progress=False)
            await asyncio.sleep(0.05)
            return results, server

    return asyncio.run(main())


def test_the_client_completes_every_shape_and_cuts_off_the_disconnects() -> None:
    reqs = soak_requests(TOKENS, decode, 40, SoakMix(max_max_tokens=8, disconnect_share=0.3), seed=1)
    results, server = soak_against("", reqs)
    cut = {r.index for r in reqs if r.disconnect_after is not None}
    assert cut and {r.index for r in results if r.outcome is Outcome.DISCONNECTED} == cut
    assert all(r.outcome is Outcome.COMPLETED for r in results if r.index not in cut), [r.error for r in results]
    assert server.client_gone == len(cut)
    for r, req in zip(results, reqs):
        assert r.index == req.index
        if r.outcome is Outcome.COMPLETED:
            assert r.timing.output_tokens == req.n * req.max_tokens
            assert (r.timing.ttft is not None) == req.stream and r.timing.latency > 0
        else:
            assert r.chunks == req.disconnect_after


def test_errors_and_lost_requests_are_told_apart() -> None:
    reqs = [SoakRequest(i, i % 2 == 0, stream, (1, 2, 3), "hi", 4) for i, stream in enumerate([True, False] * 2)]
    bad, server = soak_against("/bad", reqs * 3)
    assert {(r.outcome, r.error_type) for r in bad} == {(Outcome.ERRORED, "HTTP 503")}
    assert server.max_in_flight == 4  # the concurrency
    hang, _ = soak_against("/hang", reqs, timeout_s=0.3)
    assert {(r.outcome, r.error_type) for r in hang} == {(Outcome.LOST, "timeout")}
    cut, _ = soak_against("/cut", reqs)
    assert {(r.outcome, r.error_type) for r in cut if r.stream} == {(Outcome.ERRORED, "stream cut")}
    assert {r.outcome for r in cut if not r.stream} == {Outcome.LOST}  # no status line at all


def result(outcome: Outcome, latency: float, ttft: float | None = None, error_type: str | None = None,
           tokens: int = 10) -> SoakResult:
    timing = RequestResult(success=outcome is Outcome.COMPLETED, error=error_type, prompt_tokens=5,
                           output_tokens=tokens, ttft=ttft, latency=latency)
    return SoakResult(0, outcome, timing, stream=ttft is not None, error_type=error_type)


def test_summary_counts_outcomes_and_times_only_what_completed() -> None:
    results = [result(Outcome.COMPLETED, 1.0, 0.1), result(Outcome.COMPLETED, 2.0, 0.3), result(Outcome.COMPLETED, 3.0),
               result(Outcome.DISCONNECTED, 0.5, 0.2), result(Outcome.ERRORED, 0.1, error_type="HTTP 503"),
               result(Outcome.ERRORED, 0.1, error_type="HTTP 503"), result(Outcome.LOST, 9.0, error_type="timeout")]
    m = summarize_soak(results, duration=10.0, sent=8)
    assert (m["sent"], m["completed"], m["errored"], m["disconnected"], m["lost"]) == (8, 3, 2, 1, 2)
    assert m["failed"] == 3  # errored + lost among the results; the one never answered counts in `lost` only
    assert m["errors_by_type"] == {"HTTP 503": 2, "timeout": 1}
    assert m["median_ttft_ms"] == pytest.approx(200.0) and m["median_e2el_ms"] == pytest.approx(2000.0)
    assert m["total_output_tokens"] == 30 and m["request_throughput"] == pytest.approx(0.3)


def test_checks_fail_on_loss_leftover_work_or_memory_growth() -> None:
    idle, busy = ServerState(), ServerState(running=1, kv_usage=0.01)
    assert not failed(checks(0, idle, idle, RssReport([1], start=100, end=110), 0.10))
    assert failed(checks(1, idle, idle, RssReport([1], start=100, end=100), 0.10))
    assert failed(checks(0, idle, busy, RssReport([1], start=100, end=100), 0.10))
    grown = checks(0, idle, idle, RssReport([1], start=100, end=111), 0.10)
    assert failed(grown) and "+11.0%" in grown[2][2]
    unmeasured = checks(0, None, None, RssReport([], note="not here"), 0.10)
    assert not failed(unmeasured) and [ok for _, ok, _ in unmeasured] == [True, None, None]
    replica_died = checks(0, idle, None, RssReport([7], start=100, end=None), 0.10)
    assert [ok for _, ok, _ in replica_died] == [True, False, False] and "7 gone" in replica_died[2][2]
    rss = RssReport([1], start=100, end=130)
    rss.add_samples([(0.0, 100), (4.0, 120), (6.0, 125), (9.0, None), (10.0, 140)], duration=10.0)
    assert (rss.mid, rss.peak) == (120, 140) and rss.growth == pytest.approx(0.3)
    assert rss.second_half_growth == pytest.approx(10 / 120)
    assert counter_delta(ServerState(finished={"stop": 2}, preemptions=1),
                         ServerState(finished={"stop": 5, "abort": 1}, preemptions=1)) == \
        {"finished_abort": 1, "finished_stop": 3, "preemptions": 0}


def test_server_state_sums_replicas_and_takes_the_fullest_kv_cache() -> None:
    text = "\n".join([
        '# TYPE kvrelay:num_requests_running gauge', 'kvrelay:num_requests_running{replica="a"} 2.0',
        'kvrelay:num_requests_running{replica="b"} 1.0', '# TYPE kvrelay:kv_cache_usage_perc gauge',
        'kvrelay:kv_cache_usage_perc{replica="a"} 0.25', 'kvrelay:kv_cache_usage_perc{replica="b"} 0.5',
        '# TYPE kvrelay:request_success counter',
        'kvrelay:request_success_total{finished_reason="abort",replica="a"} 3.0',
        'kvrelay:request_success_total{finished_reason="abort",replica="b"} 1.0', ""])
    state = parse_server_state(text)
    assert state is not None and state.running == 3 and state.kv_usage == 0.5 and state.finished == {"abort": 4}
    assert not state.idle
    assert parse_server_state("# TYPE other gauge\nother 1.0\n") is None


def test_engine_replicas_are_found_by_process_title(tmp_path: Path) -> None:
    titles = {11: "ray::ServeReplica:soak:EngineWorker", 12: "ray::ServeReplica:soak:OpenAIIngress",
              13: "ray::SERVE_REPLICA::other#EngineWorker#x1:ServeReplica:other:EngineWorker.__init__     ",
              14: "python -m pytest", 15: "ray::ServeReplica:soak:PrefillWorker.handle_request",
              16: "ray::ServeReplica:fused:OpenAIIngress"}  # an app whose engine runs in its ingress
    parents = {11: 14, 12: 14, 13: 1, 14: 1, 15: 11, 16: 1}
    for pid, title in titles.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(title.encode() + b"\0--flag\0")
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (ray::x) y) S {parents[pid]} 1 1 0 -1 0 0 0 0 0 {pid} 1 0\n")
    (tmp_path / "11" / "status").write_text("Name:\tray\nVmRSS:\t  2048 kB\n")
    assert engine_replica_pids("soak", proc=tmp_path) == {11: titles[11], 15: titles[15]}
    assert sorted(engine_replica_pids(None, proc=tmp_path)) == [11, 13, 15, 16]
    assert engine_replica_pids("fused", proc=tmp_path) == {16: titles[16]}
    assert sorted(engine_replica_pids(None, ancestor=14, proc=tmp_path)) == [11, 15]
    assert rss_bytes(11, proc=tmp_path) == 2048 * 1024 and rss_bytes(12, proc=tmp_path) is None
    ticks = os.sysconf("SC_CLK_TCK")
    assert cpu_seconds([11, 12], proc=tmp_path) == pytest.approx(25 / ticks) and cpu_seconds([99], proc=tmp_path) is None
    assert serve_app_of("http://h:1/soak") == "soak" and serve_app_of("http://h:1/v1") is None and serve_app_of("http://h:1") is None


def test_a_short_soak_against_a_real_server_loses_nothing_and_leaves_the_engine_idle(
        tiny_app_url: str, tiny_model_dir: str, tmp_path: Path, capsys) -> None:
    url = tiny_app_url
    rc = bench.main(["soak", "--url", url, "--tokenizer", tiny_model_dir, "--num-requests", "60", "--concurrency", "8",
                     "--warmup", "4", "--disconnect-fraction", "0.1", "--rss-interval", "1", "--out", str(tmp_path),
                     "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    (path,) = tmp_path.glob("soak-*.json")
    (run,) = json.loads(path.read_text())["runs"]
    m, extra = run["metrics"], run["extra"]
    assert (m["sent"], m["lost"], m["errored"]) == (60, 0, 0), m["errors"]
    assert m["disconnected"] >= 1 and m["completed"] + m["disconnected"] == 60
    assert extra["server_end"]["kv_usage"] == 0 and extra["server_end"]["running"] == extra["server_end"]["waiting"] == 0
    assert len(extra["rss"]["pids"]) == 1 and extra["rss"]["growth"] is not None
    assert "[PASS] no request lost" in out and "NOT MEASURED" not in out
