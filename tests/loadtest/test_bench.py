"""`kvrelay bench`: each target writes a result JSON (and PNG plots), tables and `compare` do the right
arithmetic, and bad command lines fail with a clear message."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from compiled_kernels import needs_compiled_kernels
from loadtest import bench, decode_attention, report, runners, workloads
from loadtest.workloads import burst_output_lens

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def only_json(folder: Path) -> dict[str, Any]:
    files = list(folder.glob("*.json"))
    assert len(files) == 1, files
    return report.load_payload(files[0])


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5_000, path


def test_burst_offline_systems_write_json_and_plots(tiny_model_dir: str, tmp_path: Path, capsys) -> None:
    rc = bench.main(["burst", "--systems", "hf-naive,hf-static,engine", "--caps", "16", "--num-requests", "6",
                     "--batch-sizes", "2,4", "--model", tiny_model_dir, "--dtype", "float32", "--out", str(tmp_path),
                     "--engine-option", "kv_cache_memory=64MiB", "--plot", "--no-progress"])
    assert rc == 0
    payload = only_json(tmp_path)
    assert payload["workload"] == "burst" and payload["git_commit"] and len(payload["loadavg_start"]) == 3
    assert [r["system"] for r in payload["runs"]] == ["hf-naive", "hf-static-2", "hf-static-4", "engine"]
    want = burst_output_lens(16)[:6]
    for run in payload["runs"]:
        m = run["metrics"]
        assert run["cap"] == 16 and m["completed"] == 6 and m["failed"] == 0
        assert m["total_output_tokens"] == sum(want)
        assert m["output_throughput"] == pytest.approx(sum(want) / m["duration"])
    static4 = payload["runs"][2]["metrics"]
    padded = 4 * max(want[:4]) + 2 * max(want[4:])
    assert static4["generated_tokens"] == padded
    assert static4["padding_waste"] == pytest.approx(1 - sum(want) / padded)
    out = capsys.readouterr().out
    assert "× naive" in out and "kvrelay engine (offline)" in out
    assert payload["ceilings"]["threads"] >= 1 and payload["model_shape"]["num_layers"] == 2
    for run in payload["runs"]:  # every system judged by the compute roofline of the same useful work
        assert run["roofline"]["bound"] == "compute" and run["roofline"]["fraction"] > 0
    assert len({r["roofline"]["flops"] for r in payload["runs"]}) == 1
    assert "× compute roofline" in out and "Ceilings of this machine" in out
    stem = next(tmp_path.glob("*.json")).stem
    assert_png(tmp_path / f"{stem}-throughput.png")
    assert_png(tmp_path / f"{stem}-relative.png")


def test_poisson_offline_engine_times_every_request(tiny_model_dir: str, tmp_path: Path) -> None:
    rc = bench.main(["poisson", "--offline", "--qps", "40", "--num-requests", "8", "--model", tiny_model_dir,
                     "--dtype", "float32", "--engine-option", "kv_cache_memory=64MiB", "--out", str(tmp_path),
                     "--plot", "--no-progress", "--no-ceilings"])
    assert rc == 0
    payload = only_json(tmp_path)
    (run,) = payload["runs"]
    assert run["family"] == "engine" and run["qps"] == 40 and run["metrics"]["completed"] == 8
    ttft, e2el = run["samples"]["ttft"], run["samples"]["e2el"]
    assert len(ttft) == len(e2el) == 8 and all(0 < t <= e for t, e in zip(ttft, e2el))
    assert_png(tmp_path / f"{next(tmp_path.glob('*.json')).stem}-cdf.png")


def test_poisson_and_compare_against_a_real_server(tiny_app_url: str, tiny_model_dir: str, tmp_path: Path,
                                                   capsys) -> None:
    url = tiny_app_url
    runs = []
    for qps, sub in ((30.0, "a"), (60.0, "b")):
        out = tmp_path / sub
        rc = bench.main(["poisson", "--url", url, "--qps", str(qps), "--num-requests", "5", "--tokenizer",
                         tiny_model_dir, "--out", str(out), "--no-progress", "--no-ceilings"])
        assert rc == 0
        payload = only_json(out)
        (run,) = payload["runs"]
        m = run["metrics"]
        assert run["family"] == "url" and m["completed"] == 5 and m["failed"] == 0
        assert m["total_output_tokens"] == sum(r["output_len"] for r in _poisson_lens(tiny_model_dir, qps)[:5])
        assert all(0 < t <= e for t, e in zip(run["samples"]["ttft"], run["samples"]["e2el"]))
        runs.append(next(out.glob("*.json")))
    capsys.readouterr()
    assert bench.main(["compare", *map(str, runs)]) == 0
    table = capsys.readouterr().out
    assert "QPS 30" in table and "QPS 60" in table and table.count("| 1.00 |") >= 2


def _poisson_lens(tokenizer_dir: str, qps: float) -> list[dict[str, int]]:
    from transformers import AutoTokenizer

    from loadtest.workloads import poisson_requests

    reqs = poisson_requests(AutoTokenizer.from_pretrained(tokenizer_dir), qps)
    return [{"output_len": r.output_len} for r in reqs]


def run_record(system: str, family: str, tok_s: float, cap: int | None = 64, qps: float | None = None,
               e2e_ms: float | None = None, **extra: Any) -> dict[str, Any]:
    metrics = {"output_throughput": tok_s, "request_throughput": tok_s / 10, "duration": 100.0, "failed": 0}
    if e2e_ms is not None:
        metrics.update(mean_e2el_ms=e2e_ms, median_ttft_ms=10.0, p95_ttft_ms=20.0)
    return {"system": system, "family": family, "workload": "burst" if cap else "poisson", "cap": cap, "qps": qps,
            "metrics": metrics, "samples": {"e2el": [1.0], "ttft": [0.1]} if e2e_ms else {}, "extra": extra}


def test_burst_table_picks_the_best_static_batch_and_takes_ratios() -> None:
    runs = [run_record("hf-naive", "hf-naive", 20.0), run_record("hf-static-8", "hf-static", 40.0, batch_size=8),
            run_record("hf-static-32", "hf-static", 50.0, batch_size=32), run_record("engine", "engine", 150.0)]
    assert report.best_of_family(runs, "hf-static")["system"] == "hf-static-32"
    table = report.burst_table(runs)
    engine_row = next(line for line in table.splitlines() if "engine" in line)
    assert "| 150.0 |" in engine_row and "| 7.50 | 3.00 |" in engine_row
    assert "HF static, batch 32" in table and "batch 8" not in table


def test_compare_takes_ratios_within_each_group(tmp_path: Path) -> None:
    a = {"format": report.FORMAT, "workload": "poisson",
         "runs": [run_record("engine", "engine", 100.0, cap=None, qps=4.0, e2e_ms=2000.0)]}
    b = {"format": report.FORMAT, "workload": "poisson",
         "runs": [run_record("server", "server", 80.0, cap=None, qps=4.0, e2e_ms=3000.0),
                  run_record("server", "server", 10.0, cap=None, qps=1.0, e2e_ms=1000.0)]}
    by = _cells(report.compare_table([("a", a), ("b", b)]))
    assert by[("QPS 4", "engine (a)")][4] == "1.00"
    assert by[("QPS 4", "server (b)")][4] == "0.80" and by[("QPS 4", "server (b)")][8] == "1.50"
    assert by[("QPS 1", "server (b)")][4] == "1.00"  # alone in its group: its own baseline
    by = _cells(report.compare_table([("a", a), ("b", b)], baseline="server"))
    assert by[("QPS 4", "engine (a)")][4] == "1.25"


def _cells(table: str) -> dict[tuple[str, str], list[str]]:
    """Rows of a compare table keyed by (param, system): workload, param, system, tok/s, × tok/s, ..., × e2e."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    return {(r[1], r[2]): r for r in rows}


def test_compare_rejects_files_that_are_not_results(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    assert bench.main(["compare", str(bad)]) == 2
    assert "not a kvrelay bench result" in capsys.readouterr().err
    assert bench.main(["compare", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("argv, needle", [
    (["burst"], "choose what to measure"),
    (["burst", "--systems", "engine,vllm"], "unknown systems"),
    (["poisson", "--systems", "hf-naive"], "unknown systems"),
    (["burst", "--offline", "--caps", "32"], "burst caps"),
    (["burst", "--offline", "--num-requests", "0"], "--num-requests"),
    (["poisson", "--offline", "--request-rate", "-1"], "--request-rate"),
    (["random", "--offline", "--range-ratio", "1.5"], "--range-ratio"),
    (["policies", "--policies", "fcfs,lifo"], "unknown policies: lifo; choose from fcfs, priority, sjf, predicted"),
    (["single", "--offline", "--output-len", "0"], "--output-len must be >= 1"),
    (["single", "--offline", "--top-p", "0.9"], "--top-p and --top-k need --temperature > 0"),
    (["single", "--offline", "--temperature", "-1"], "--temperature must be >= 0"),
    (["single", "--offline", "--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["single", "--offline", "--temperature", "1", "--top-k", "0"], "--top-k must be -1 (off) or >= 1"),
    (["burst", "--systems", "hf-naive,engine", "--temperature", "0.7"], "hf-naive decode greedily"),
    (["long-prompt", "--temperature", "0.7"], "the long-prompt suite decodes greedily; --temperature needs --url"),
    (["decode-attention", "--batch", "0"], "--batch, --context, --threads, --rounds, --repeats and --layers must be >= 1"),
    (["decode-attention", "--layers", "0"], "--batch, --context, --threads, --rounds, --repeats and --layers must be >= 1"),
])
def test_bad_command_lines_fail_clearly(argv: list[str], needle: str, capsys) -> None:
    assert bench.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_a_model_folder_without_a_config_names_the_way_out(tmp_path: Path, default_model_dir: str, capsys) -> None:
    assert bench.main(["single", "--offline", "--model", str(tmp_path), "--tokenizer", default_model_dir]) == 2
    err = capsys.readouterr().err
    assert "no config.json" in err and "--no-ceilings" in err


def test_kvrelay_cli_dispatches_to_bench(capsys) -> None:
    from serving.cli import main

    assert main(["bench", "burst"]) == 2
    assert "choose what to measure" in capsys.readouterr().err


def test_random_requests_are_seeded_and_within_range(tokenizer) -> None:
    a = workloads.random_requests(tokenizer, 50, 100, 40, 0.25, seed=3)
    b = workloads.random_requests(tokenizer, 50, 100, 40, 0.25, seed=3)
    assert a == b
    assert all(75 <= len(r.prompt_token_ids) <= 125 and 30 <= r.output_len <= 50 for r in a)
    assert len({len(r.prompt_token_ids) for r in a}) > 5
    fixed = workloads.random_requests(tokenizer, 5, 16, 8, 0.0, seed=0)
    assert {(len(r.prompt_token_ids), r.output_len) for r in fixed} == {(16, 8)}


@contextmanager
def fake_server() -> Iterator[tuple[Any, str]]:
    """The imitation `/v1/completions` server of test_http_client, on its own event loop in a thread (the
    bench CLI runs its own `asyncio.run`)."""
    from test_http_client import serve

    loop = asyncio.new_event_loop()
    state: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        state["stop"] = asyncio.Event()
        async with serve() as (server, url):
            state.update(server=server, url=url)
            ready.set()
            await state["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield state["server"], state["url"]
    finally:
        loop.call_soon_threadsafe(state["stop"].set)
        thread.join(10)
        loop.close()


def test_burst_against_a_url_sends_the_workload_unstreamed(tmp_path: Path, default_model_dir: str) -> None:
    with fake_server() as (server, url):
        rc = bench.main(["burst", "--url", url, "--model", "m", "--caps", "16", "--num-requests", "6",
                         "--out", str(tmp_path), "--plot", "--no-progress", "--no-ceilings"])
    assert rc == 0
    (run,) = only_json(tmp_path)["runs"]
    want = burst_output_lens(16)[:6]
    assert run["family"] == "url" and run["metrics"]["completed"] == 6
    assert run["metrics"]["total_output_tokens"] == sum(want)
    bodies = server.bodies[1:]  # the first is the warm-up
    assert [b["max_tokens"] for b in bodies] == want and not any(b["stream"] for b in bodies)
    assert all(len(b["prompt"]) == 128 and b["ignore_eos"] for b in bodies)
    assert_png(tmp_path / f"{next(tmp_path.glob('*.json')).stem}-throughput.png")


def test_sampling_options_reach_every_request_and_the_result(tmp_path: Path, default_model_dir: str) -> None:
    with fake_server() as (server, url):
        rc = bench.main(["burst", "--url", url, "--model", "m", "--caps", "16", "--num-requests", "3",
                         "--temperature", "0.7", "--top-p", "0.9", "--top-k", "50",
                         "--out", str(tmp_path), "--no-progress", "--no-ceilings"])
    assert rc == 0
    assert only_json(tmp_path)["parameters"]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 50}
    bodies = server.bodies[1:]  # the first is the warm-up, greedy
    assert len(bodies) == 3 and all((b["temperature"], b["top_p"], b["top_k"]) == (0.7, 0.9, 50) for b in bodies)
    assert server.bodies[0]["temperature"] == 0 and "top_p" not in server.bodies[0]


def test_single_offline_samples_when_asked(tiny_model_dir: str, tmp_path: Path, monkeypatch) -> None:
    import workers.sampler as sampler

    nucleus_rows = []
    real = sampler._sample_filtered
    monkeypatch.setattr(sampler, "_sample_filtered", lambda x, k, p, u: nucleus_rows.extend(p) or real(x, k, p, u))
    rc = bench.main(["single", "--offline", "--num-requests", "2", "--input-len", "16", "--output-len", "8",
                     "--temperature", "1.0", "--top-p", "0.8", "--model", tiny_model_dir, "--dtype", "float32",
                     "--engine-option", "kv_cache_memory=64MiB", "--out", str(tmp_path), "--no-progress",
                     "--no-ceilings"])
    assert rc == 0
    payload = only_json(tmp_path)
    assert payload["parameters"]["sampling"] == {"temperature": 1.0, "top_p": 0.8}
    assert payload["runs"][0]["metrics"]["total_output_tokens"] == 16
    assert len(nucleus_rows) >= 16 and set(nucleus_rows) == {0.8}  # a row per timed token (the warm-up is greedy)


def test_random_workload_honours_rate_and_concurrency(tmp_path: Path, default_model_dir: str, capsys) -> None:
    with fake_server() as (server, url):
        rc = bench.main(["random", "--url", url, "--model", "m", "--num-requests", "20", "--input-len", "50",
                         "--output-len", "10", "--range-ratio", "0.5", "--request-rate", "200", "--burstiness", "0.5",
                         "--max-concurrency", "3", "--out", str(tmp_path), "--no-progress", "--no-ceilings"])
    assert rc == 0
    (run,) = only_json(tmp_path)["runs"]
    assert run["metrics"]["completed"] == 20 and run["qps"] == 200
    assert server.max_in_flight <= 3
    assert all(25 <= len(b["prompt"]) <= 75 and 5 <= b["max_tokens"] <= 15 for b in server.bodies[1:])
    assert "Successful requests" in capsys.readouterr().out


def test_failed_requests_are_counted_and_fail_the_run(tmp_path: Path, default_model_dir: str) -> None:
    with fake_server() as (_, url):
        rc = bench.main(["poisson", "--url", url + "/bad", "--model", "m", "--qps", "100", "--num-requests", "5",
                         "--out", str(tmp_path), "--no-progress", "--no-ceilings"])
    assert rc == 1
    (run,) = only_json(tmp_path)["runs"]
    assert run["metrics"]["failed"] == 5 and run["metrics"]["completed"] == 0
    assert run["metrics"]["errors"] == {"HTTP 503: server overloaded": 5}


def test_long_prompt_against_a_url_splits_short_and_long(tmp_path: Path, default_model_dir: str) -> None:
    with fake_server() as (server, url):
        rc = bench.main(["long-prompt", "--url", url, "--model", "m", "--num-requests", "12", "--out", str(tmp_path),
                         "--no-progress"])
    assert rc == 0
    (run,) = only_json(tmp_path)["runs"]
    n_long = sum(len(b["prompt"]) == 2048 for b in server.bodies[1:])
    assert run["extra"]["long"]["completed"] == n_long and run["extra"]["short"]["completed"] == 12 - n_long


def test_train_predictor_generates_lengths_fits_and_saves(tiny_model_dir: str, tmp_path: Path, capsys,
                                                          monkeypatch) -> None:
    from loadtest import predictor as predictor_module
    from workers.length_predictor import LinearLengthPredictor

    # the random-weight model rarely stops by itself: a lower cap than the workload's 384 keeps the run short
    monkeypatch.setattr(predictor_module, "POISSON_OUTPUT_CAP", 48)
    out = tmp_path / "pred.json"
    rc = bench.main(["train-predictor", "--model", tiny_model_dir, "--dtype", "float32", "--num-prompts", "110",
                     "--output", str(out)])
    assert rc == 0
    lengths = json.loads((tmp_path / "pred-lengths.json").read_text())
    assert len(lengths["lengths"]) == 110 and all(1 <= n <= 48 for n in lengths["lengths"])
    assert lengths["max_tokens"] == 48
    predictor = LinearLengthPredictor.load(out)
    assert predictor.meta["report"]["num_train"] == 10 and predictor.meta["report"]["num_held_out"] == 100
    assert "| predictor |" in capsys.readouterr().out
    # refit from the saved lengths: same data, same model
    again = tmp_path / "again.json"
    assert bench.main(["train-predictor", "--model", tiny_model_dir, "--lengths", str(tmp_path / "pred-lengths.json"),
                       "--output", str(again)]) == 0
    assert LinearLengthPredictor.load(again).weights == pytest.approx(predictor.weights)


def test_servers_run_after_every_in_process_system() -> None:
    order = runners._run_order(["hf-naive", "server", "engine"], [16, 64])
    assert order == [("hf-naive", 16), ("engine", 16), ("hf-naive", 64), ("engine", 64), ("server", 16), ("server", 64)]
    assert runners._run_order(["url"], [1.0]) == [("url", 1.0)]


def test_single_offline_runs_one_stream_at_a_time_against_the_bandwidth_roofline(tiny_model_dir: str, tmp_path: Path,
                                                                                    capsys) -> None:
    rc = bench.main(["single", "--offline", "--num-requests", "2", "--input-len", "32", "--output-len", "16",
                     "--model", tiny_model_dir, "--dtype", "float32", "--engine-option", "kv_cache_memory=64MiB",
                     "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    payload = only_json(tmp_path)
    (run,) = payload["runs"]
    m = run["metrics"]
    assert payload["workload"] == "single" and run["family"] == "engine"
    assert m["completed"] == 2 and m["total_input_tokens"] == 64 and m["total_output_tokens"] == 32
    assert payload["ceilings"]["dtype"] == "float32" and payload["ceilings"]["read_gbs"] > 0
    rf = run["roofline"]
    assert rf["bound"] == "memory" and rf["decode_context"] == 32 + 8
    assert rf["decode_tok_s"] == pytest.approx(1000 / m["median_tpot_ms"])
    assert rf["fraction"] == pytest.approx(rf["decode_tok_s"] / rf["decode_ceiling_tok_s"])
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "× bandwidth roofline" in out


def test_single_against_a_url_streams_one_request_at_a_time(tmp_path: Path, default_model_dir: str) -> None:
    with fake_server() as (server, url):
        rc = bench.main(["single", "--url", url, "--model", "m", "--num-requests", "3", "--max-concurrency", "8",
                         "--out", str(tmp_path), "--no-progress", "--no-ceilings"])
    assert rc == 0
    payload = only_json(tmp_path)
    (run,) = payload["runs"]
    assert run["metrics"]["completed"] == 3 and "roofline" not in run and "ceilings" not in payload
    assert server.max_in_flight == 1
    bodies = server.bodies[1:]
    assert all(b["stream"] and len(b["prompt"]) == 128 and b["max_tokens"] == 128 for b in bodies)
    assert len({tuple(b["prompt"]) for b in bodies}) == 3  # distinct prompts: no prefix-cache hits


def test_roofline_table_and_compare_print_each_runs_fraction() -> None:
    roofline = {"bound": "memory", "fraction": 0.42, "flops": 3e12, "achieved_gflops": 30.0, "compute_seconds": 10.0,
                "compute_fraction": 0.1, "bytes_per_token": 270e6, "decode_tok_s": 21.0, "decode_ceiling_tok_s": 50.0,
                "decode_fraction": 0.42}
    with_roofline = {**run_record("server", "server", 80.0, cap=None, qps=4.0, e2e_ms=3000.0), "roofline": roofline}
    table = report.roofline_table([with_roofline, run_record("engine", "engine", 100.0)])
    (row,) = [line for line in table.splitlines() if "kvrelay serve" in line]
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    head = [c.strip() for c in table.splitlines()[0].strip().strip("|").split("|")]
    by = dict(zip(head, cells))
    assert by["param"] == "QPS 4" and by["bound"] == "memory" and by["× bandwidth roofline"] == "0.42"
    assert by["× compute roofline"] == "0.10" and by["GFLOP/s"] == "30.0" and by["ceiling tok/s"] == "50.0"
    assert by["lockstep s"] == by["× lockstep"] == "-"  # a file from before the lockstep bound
    lockstep = {**with_roofline, "roofline": {**roofline, "lockstep_seconds": 25.0, "lockstep_fraction": 0.25,
                                              "attainable_compute_fraction": 0.4}}
    (row,) = [line for line in report.roofline_table([lockstep]).splitlines() if "kvrelay serve" in line]
    by = dict(zip(head, [c.strip() for c in row.strip().strip("|").split("|")]))
    assert (by["lockstep s"], by["× lockstep"], by["lockstep × compute roofline"]) == ("25.00", "0.25", "0.40")
    assert "engine" not in table  # a run without a roofline (--no-ceilings, an older file) has no row
    old = {"format": report.FORMAT, "workload": "poisson", "runs": [run_record("engine", "engine", 100.0, cap=None,
                                                                              qps=4.0, e2e_ms=2000.0)]}
    new = {"format": report.FORMAT, "workload": "poisson", "runs": [with_roofline]}
    by = _cells(report.compare_table([("old", old), ("new", new)]))
    assert by[("QPS 4", "server (new)")][10] == "0.42 (memory)" and by[("QPS 4", "engine (old)")][10] == "-"
    assert report.roofline_tables(old) == []


def test_plot_together_draws_the_runs_of_several_files_in_one_figure(tmp_path: Path, capsys) -> None:
    files = []
    for name, tok_s in (("a", 100.0), ("b", 80.0)):
        payload = {"format": report.FORMAT, "workload": "poisson",
                   "runs": [run_record("server", "server", tok_s, cap=None, qps=4.0, e2e_ms=2000.0)]}
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(payload))
    stem = tmp_path / "both"
    assert bench.main(["plot", "--together", str(stem), "--labels", "vLLM,kvrelay", *map(str, files)]) == 0
    assert (tmp_path / "both-cdf.png").stat().st_size > 0
    assert bench.main(["plot", "--together", str(stem), "--labels", "only-one", *map(str, files)]) == 2
    assert "--labels names 1 files, and 2 were given" in capsys.readouterr().err
    burst = tmp_path / "burst.json"
    burst.write_text(json.dumps({"format": report.FORMAT, "workload": "burst", "runs": [run_record("e", "engine", 1.0)]}))
    assert bench.main(["plot", "--together", str(stem), str(files[0]), str(burst)]) == 2
    assert "one workload" in capsys.readouterr().err


def test_decode_attention_bench_sweeps_enough_layers_to_read_past_the_last_level_cache() -> None:
    mib = 2**20
    assert decode_attention.auto_layers(40 * mib, 480 * mib) == 24  # twice the cache, rounded up
    assert decode_attention.auto_layers(40 * mib, None) == 4  # 64 MiB assumed
    assert decode_attention.auto_layers(100 * mib, 32 * mib) == 1
    assert decode_attention.auto_layers(1000, 480 * mib) == decode_attention.MAX_AUTO_LAYERS
    llc = decode_attention.last_level_cache_bytes()
    assert llc is None or llc >= 2**10


@needs_compiled_kernels
def test_decode_attention_bench_reports_the_kernel_against_a_plain_read(tmp_path: Path, capsys) -> None:
    from kernels.cpu_extension import load_extension

    if not load_extension().has_avx512_bf16():
        assert bench.main(["decode-attention", "--batch", "2"]) == 2
        assert "AVX512-BF16" in capsys.readouterr().err
        return
    argv = ["decode-attention", "--batch", "4", "--context", "40", "--rounds", "1", "--repeats", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    assert "of the read ceiling" in capsys.readouterr().out
    (path,) = tmp_path.glob("decode-attention-*.json")
    result = json.loads(path.read_text())
    assert result["command"] == "kvrelay bench " + " ".join(argv)
    assert result["kernel_gbs"] > 0 and result["read_gbs"] > 0 and len(result["kernel_ms"]) == 1
    assert result["fraction_of_read"] == pytest.approx(result["kernel_gbs"] / result["read_gbs"], rel=0.01)
    assert result["layers"] == decode_attention.auto_layers(4 * 3 * 16 * 3 * 64 * 2 * 2, result["last_level_cache_bytes"])
    assert bench.main(argv[:-2] + ["--layers", "3"]) == 0
    assert "3 layers:" in capsys.readouterr().out
    assert bench.main(["decode-attention", "--head-dim", "48"]) == 2
    assert "head_dim 48" in capsys.readouterr().err
