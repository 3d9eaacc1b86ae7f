"""`python -m loadtest.gpu_check`: its dry run completes on the CPU with every check passing (or skipped for a
stated reason) and writes the JSON the GPU run will; it imports without Ray or pydantic, which the GPU
machine lacks; and its random weights have the names the loader takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["triton_warmup", "environment", "kernel_parity", "greedy_cpu_vs_device", "greedy_graphs_on_vs_off",
            "greedy_speculative_vs_plain", "aot_fidelity", "attention_sweep", "linear_sweep", "throughput",
            "sync_audit", "decode_profile", "pd_handoff", "random_workload", "tensor_parallel"]
IMPORT_WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # a None entry makes `import ray` raise ImportError
sys.modules["pydantic"] = None
import loadtest.gpu_check.run, loadtest.gpu_check.engines, loadtest.gpu_check.greedy_parity
import loadtest.gpu_check.kernel_parity, loadtest.gpu_check.throughput, loadtest.gpu_check.pd_handoff
import loadtest.gpu_check.attention_sweep, loadtest.gpu_check.linear_sweep, loadtest.gpu_check.timing
import loadtest.gpu_check.sync_audit, loadtest.gpu_check.random_workload
import kernels.triton_attention, workers.cuda_graphs, workers.kv_transfer
from loadtest.gpu_check.pd_handoff import transport_available
transport_available()
print("ok")
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_imports_without_ray_or_pydantic():
    proc = subprocess.run([sys.executable, "-c", IMPORT_WITHOUT_RAY], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_random_weights_cover_the_loader(tmp_path):
    import torch

    from loadtest.gpu_check.model_files import TINY_SHAPE, model_config, random_weights
    from workers.models.llama import LlamaForCausalLM, ModelArgs

    class Config:
        def __init__(self, d: dict) -> None:
            self.__dict__.update(d)

    config = model_config(TINY_SHAPE)
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelArgs.from_hf_config(Config(config)))
    model = model.to_empty(device="cpu")
    weights = random_weights(config)
    model.load_hf_weights(weights.items())  # raises on a missing name or a wrong shape
    assert 0.015 < float(weights["model.embed_tokens.weight"].std()) < 0.025
    assert abs(float(weights["model.norm.weight"].mean()) - 1) < 0.01


def test_dry_run_completes_and_every_check_passes(tmp_path):
    import dataclasses

    from kernels.triton_linear import LinearConfig

    proc = subprocess.run([sys.executable, "-m", "loadtest.gpu_check", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = report["checks"]
    assert report["mode"] == "dry-run" and list(checks) == SECTIONS
    assert report["all_passed"] and not report["failed"] and not report["error"], {
        k: v.get("error") for k, v in checks.items()}
    assert sorted(report["passed"] + report["skipped"]) == sorted(SECTIONS)
    assert checks["environment"]["torch"] and "nccl" in checks["environment"]
    cases = checks["kernel_parity"]["cases"]
    assert {(c["dtype"], c["block_size"]) for c in cases} == {(d, b) for d in ("float32", "bfloat16")
                                                              for b in (1, 16, 32)}
    assert all(c["max_abs_error"] <= c["tolerance"] for c in cases)
    # the optional FlashAttention packages: not on this machine (where they are, their self-check's outcome)
    assert set(checks["kernel_parity"]["optional_backends"]) == {"flash_attn", "vllm_flash_attn", "flashinfer"}
    assert all(v.startswith("not installed") for v in checks["kernel_parity"]["optional_backends"].values())
    for name in ("greedy_cpu_vs_device", "greedy_graphs_on_vs_off"):
        assert checks[name]["identical_fraction"] == 1.0 and checks[name]["all_match"]
    # the graphs' tokens came (in part) from steps whose inputs were advanced on the device, as on a GPU
    parity = checks["greedy_graphs_on_vs_off"]
    assert parity["async_scheduling"] and parity["advanced_steps"] > 0
    sweep = checks["attention_sweep"]
    assert len(sweep["configs"]) >= 2 and all(r["ok"] and r["us"] > 0 for r in sweep["configs"])
    assert sweep["applied"] is None and sweep["default"] in [r["config"] for r in sweep["configs"]]
    one = sweep["one_sequence"]  # one stream, its keys split between programs: the same output
    assert one["ok"] and one["splits"] > 1 and one["auto_splits_us"] > 0 and not one["applied"]
    # programmatic dependent launch (ignored on the CPU) against none: the same bits, never applied in a dry run
    pdl = sweep["pdl"]
    assert pdl["ok"] and pdl["max_abs_diff"] == 0 and pdl["us"] > 0 and pdl["pdl_us"] > 0 and not pdl["applied"]
    linear = checks["linear_sweep"]
    assert set(linear["rows"]) == {"1", "2"} and linear["default"] is None  # the separate kernels by default
    for rows, data in linear["rows"].items():
        assert data["separate_us"] > 0 and len(data["configs"]) >= (3 if rows == "2" else 1)
        assert all(r["ok"] and r["us"] > 0 and r["max_rel_diff"] < 0.03 for r in data["configs"])
    assert any(r["config"]["plain_matmuls"] for r in linear["rows"]["2"]["configs"])
    assert not linear["applied_to_later_sections"]
    # the applied config (none here: the fused kernels' default config) and the fastest plain one, each with
    # and without
    pdl = linear["pdl"]
    assert [r["config"]["plain_matmuls"] for r in pdl["configs"]] == [False, True] and not pdl["applied"]
    assert all(r["ok"] and r["max_abs_diff"] == 0 and r["pdl_us"] > 0 for r in pdl["configs"])
    assert pdl["choice"] == dataclasses.asdict(LinearConfig()) and linear["applied"] == "separate kernels"
    # the separate kernels' small ones with programmatic dependent launch and without: the same bits
    small = linear["small_ops_pdl"]
    assert small["ok"] and small["max_abs_diff"] == 0 and small["us"] > 0 and small["pdl_us"] > 0
    assert not small["applied"] and small["pdl"] is False is small["default"]
    tp = checks["throughput"]
    assert [tp["batch"][k]["async_scheduling"] for k in ("graphs", "eager", "graphs_in_turn",
                                                        "graphs_outputs_in_step")] == [True, True, False, False]
    # the engine's default speculation (on the CPU, whose engines capture no graphs, without a batch limit), and
    # drafts at any batch
    spec, always = tp["batch"]["graphs_speculating"], tp["batch"]["graphs_drafting_always"]
    assert spec["num_speculative_tokens"] == always["num_speculative_tokens"] == 4
    assert spec["speculative_disable_by_batch_size"] is None and always["speculative_disable_by_batch_size"] == 2
    for b in (spec, always):
        assert b["async_scheduling"] is False and b["output_tokens"] == b["requests"] * b["output_len"]
        assert b["draft_tokens"] >= b["kept_drafts"] >= 0
    assert tp["batch"]["graphs"]["num_speculative_tokens"] == 0 and "draft_tokens" not in tp["batch"]["graphs"]
    # a step queued ahead over the rows of the graph step before advances its buffers on the device; the default
    # runs again last, to show whether its place in the order moved its step
    again = tp["batch"]["graphs_again"]
    assert tp["batch"]["graphs"]["advanced_steps"] >= 1 and again["advanced_steps"] >= 1
    assert tp["batch"]["graphs_in_turn"]["advanced_steps"] == tp["batch"]["eager"]["advanced_steps"] == 0
    assert again["async_scheduling"] and again["output_tokens"] == again["requests"] * again["output_len"]
    assert tp["batch"]["graphs"]["decode_attention_config"] == sweep["default"]
    assert tp["batch"]["graphs"]["norm_linear_config"] == linear["default"]  # the dry run applies neither
    assert tp["batch"]["graphs"]["small_ops_pdl"] is False
    assert not tp["targets_applied"] and set(tp["targets"]) == {"decode_roofline_fraction_with_graphs",
                                                                 "batch1_graphs_over_eager"}
    for kind in ("graphs", "eager"):
        assert tp["batch"][kind]["output_tokens"] == tp["batch"][kind]["requests"] * tp["batch"][kind]["output_len"]
        assert 0 < tp["batch"][kind]["roofline_fraction"] and tp["batch1"][kind]["decode_tok_s"] > 0
    assert tp["copy_bandwidth_gb_s"] > 0 and tp["batch1_graphs_over_eager"] > 0
    # the audit walked the batches' steps (no sync debug mode on the CPU: copies from pageable memory stand in)
    audit = checks["sync_audit"]
    assert audit["status"] == "passed" and audit["async_scheduling"] and not audit["sync_debug_mode"]
    for run in (audit, audit["varied"]):
        assert run["decode"]["steps"] >= 1 and run["other"]["steps"] >= 1
        assert run["decode"]["synchronizing_calls"] == run["other"]["synchronizing_calls"] == 0
    assert audit["varied"]["steps_queued_ahead"] >= 1
    # the random workload: the GPU's decode path (graphs replayed eagerly, async forced), without speculation
    # and with it, against the torch backend in turn, every request's outputs the same, preempting and
    # advancing steps, keeping drafts and queuing steps ahead
    rw = checks["random_workload"]
    assert rw["status"] == "passed" and rw["exercised"] and len(rw["runs"]) == 1
    plain, speculating = rw["runs"][0]["decode_path"], rw["runs"][0]["speculating"]
    assert plain["mismatch_count"] == speculating["mismatch_count"] == 0 and plain["most_running"] > 8
    assert plain["drafts"] == 0 and speculating["drafts_kept"] > 0 and speculating["steps_queued_ahead"] > 0
    pd = checks["pd_handoff"]
    assert pd["status"] == "passed" and pd["tokens"] == pd["colocated_tokens"] or (
        pd["status"] == "skipped" and pd["reason"].startswith("cuda_ipc transport not available"))
    assert checks["tensor_parallel"]["status"] == "skipped"
    assert checks["tensor_parallel"]["reason"].startswith("dry run")
    assert checks["aot_fidelity"]["status"] == "skipped" and checks["aot_fidelity"]["reason"].startswith("dry run")
    assert checks["triton_warmup"]["status"] == "skipped" and checks["triton_warmup"]["reason"].startswith("dry run")
    assert "ALL PASSED" in proc.stdout


def test_only_runs_the_named_sections_and_separate_kernels_skips_the_linear_sweep(tmp_path):
    """`--only` (a rerun within what is left of a lease) runs the named sections and `environment`, and
    records every other one as skipped; an unknown name is refused. `--separate-kernels` (a rerun's fallback
    if the fused norm-and-matmul kernels fail on a GPU) skips the linear sweep, which would apply them."""
    proc = subprocess.run([sys.executable, "-m", "loadtest.gpu_check", "--dry-run", "--out", str(tmp_path),
                           "--only", "kernel_parity,linear_sweep", "--separate-kernels"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["complete"] and sorted(report["passed"]) == ["environment", "kernel_parity"]
    assert list(report["checks"]) == SECTIONS
    assert report["checks"]["linear_sweep"] == {"status": "skipped", "reason": "--separate-kernels"}
    assert all(report["checks"][s]["reason"] == "not in --only" for s in report["skipped"] if s != "linear_sweep")
    bad = subprocess.run([sys.executable, "-m", "loadtest.gpu_check", "--dry-run", "--out", str(tmp_path),
                          "--only", "throughput,nonsense"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unknown sections ['nonsense']" in bad.stderr


COMPILE_CLOCK = """
import json, torch
from kernels.triton_aot import compile_variant
from loadtest.gpu_check.run import _CompileClock
from workers.kernel_variants import engine_variants

variant, kernel = next((v, k) for v, k in engine_variants(("tiny",), (torch.float32,)).items()
                       if v.name == "_rms_norm_kernel")
with _CompileClock() as clock:
    compile_variant(kernel, variant, 90)
    compile_variant(kernel, variant, 90)  # found in the cache: not counted
print(json.dumps(clock.report()))
"""


def _compiling(script: str, tmp_path) -> dict:
    """`script`'s last line of output, as JSON, run without Triton's interpreter and with a cache of its own."""
    env = {k: v for k, v in _env().items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sections_count_the_triton_kernels_they_compile(tmp_path):
    """Each section reports the Triton compilations it waited for (a lease's JIT time), cache hits excluded."""
    report = _compiling(COMPILE_CLOCK, tmp_path)
    assert report["compiled"] == 1 and report["seconds"] > 0
    assert list(report["by_kernel"]) == ["_rms_norm_kernel"]
    assert report["variants_seen"] == 1  # the hit too


AOT_FIDELITY = """
import json, torch
from kernels.triton_aot import compile_variant
from loadtest.gpu_check import run
from workers.kernel_variants import engine_variants

# a section whose launches compile two of the shape's variants, and one the recording does not give (another
# tile height of the fused kernel)
recorded = [(v, k) for v, k in engine_variants(("smollm2-135m",), (torch.bfloat16,)).items()
            if v.name == "_norm_linear_kernel"]
with run._CompileClock() as clock:
    for v, k in recorded[:2]:
        compile_variant(k, v, 90)
run.JIT_VARIANTS["a"] = clock.variants
good = run.aot_fidelity(("a",))
v, k = recorded[0]
names = [n for n, _ in v.signature]
consts = tuple((i, 128 if names[i] == "BLOCK_M" else c) for i, c in v.constexprs)
with run._CompileClock() as clock:
    compile_variant(k, v.__class__(v.name, v.signature, consts, v.attrs, v.options), 90)
run.JIT_VARIANTS["b"] = clock.variants
bad = run.aot_fidelity(("a", "b"))
print(json.dumps({"good": good, "bad": bad}))
"""


def test_aot_fidelity_finds_a_jit_variant_the_recording_misses(tmp_path):
    out = _compiling(AOT_FIDELITY, tmp_path)
    assert out["good"]["passed"] and out["good"]["jit_variants"] == 2 and not out["good"]["missing"]
    assert not out["bad"]["passed"] and out["bad"]["missing_count"] == 1
    assert "BLOCK_M=128" in out["bad"]["missing"][0]


WARMUP = """
import json
from loadtest.gpu_check.warmup import warm_triton_cache
print(json.dumps(warm_triton_cache(arch=90, jobs=2, sweeps=False)))
"""


def test_the_warmup_compiles_what_the_engine_sections_launch():
    """The check's first section fills Triton's cache, in parallel and in a process of its own, with the variants
    the engine sections launch (their keys are the JIT's: tests/workers/test_kernel_variants.py). Triton's own
    cache here, which the sm_90 compile test finds them in later."""
    env = {k: v for k, v in _env().items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", WARMUP], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["passed"] and report["arch"] == 90 and report["compiled"] == report["variants"] > 40


def test_a_warmup_past_its_time_is_stopped():
    from loadtest.gpu_check.warmup import warm_triton_cache

    report = warm_triton_cache(arch=90, jobs=1, sweeps=False, timeout_s=0.5)
    assert not report["passed"] and "did not finish within" in report["error"]


@pytest.mark.foreground  # it times sleeps of 2 and 20 ms: at idle priority a wake-up can wait longer
def test_a_decode_steps_time_is_its_period_not_its_call():
    """With async scheduling the device runs the step queued ahead while the host is between `step()` calls, so
    a step's time is from its call to the next one's: the time outside the calls counts (here 20 ms spent
    before each call, against 2 ms in it), and only decode-only steps of the whole batch are timed, each with
    the context it reads."""
    import time
    from types import SimpleNamespace

    import torch

    from loadtest.gpu_check.engines import decode_context
    from loadtest.gpu_check.throughput import _timed_run

    class Engine:
        device = torch.device("cpu")

        def __init__(self):
            self.scheduler = SimpleNamespace(running=[], num_waiting=0)

        def add_request(self, request_id, prompt, params, prompt_token_ids, output_kind):
            self.scheduler.running.append(SimpleNamespace(num_tokens=len(prompt_token_ids), num_computed_tokens=0))

        def has_unfinished_requests(self):
            time.sleep(0.02)  # the host's time between calls, while a GPU would run the step queued ahead
            return self.scheduler.running[0].num_tokens < 8

        def step(self):
            time.sleep(0.002)
            for r in self.scheduler.running:  # the prefill, then decodes: all tokens computed, one more made
                r.num_computed_tokens, r.num_tokens = r.num_tokens, r.num_tokens + 1
            return []

    engine = Engine()
    run = _timed_run(engine, [[5, 6, 7], [8, 9]], max_tokens=8)
    # a prefill (not timed), then decode steps at 7, 9, 11 and 13 tokens of context; the last has no next call
    assert [c for _, c in run["decode_steps"]] == [7, 9, 11]
    assert all(t >= 0.02 for t, _ in run["decode_steps"]), run["decode_steps"]
    assert all(t < 0.015 for t in run["decode_calls"]) and len(run["decode_calls"]) == 4
    engine.scheduler.num_waiting = 1
    assert decode_context(engine, 2) is None


def test_the_speculative_parity_check_lets_every_prompt_draft(monkeypatch):
    """With CUDA graphs the engine drafts only for as many requests as its largest graph holds with their drafts
    (`default_speculation_limit`); the check's engines, sized to the prompts alone, drafted for one of eight,
    and none drafted on the GPU. Both its engines now hold every prompt's step with its drafts."""
    import dataclasses

    from loadtest.gpu_check import greedy_parity
    from loadtest.gpu_check.plan import Plan
    from workers.config import EngineConfig, default_speculation_limit

    seen: list[dict] = []

    def run(plan, model, dtype, device, backend, graphs, prompts, speculative_tokens=0, drafts=None,
            max_num_seqs=None):
        seen.append({"prompts": len(prompts), "rows": max_num_seqs, "spec": speculative_tokens})
        if drafts is not None:
            drafts.update(drafts=1, kept=1)
        return [[1, 2]] * len(prompts)

    monkeypatch.setattr(greedy_parity, "_run", run)
    plan = dataclasses.replace(Plan.dry(), parity_prompts=8)
    assert greedy_parity.speculative_vs_plain(plan, "m", 100)["passed"]
    assert [s["spec"] for s in seen] == [0, 4] and seen[0]["rows"] == seen[1]["rows"]  # like with like
    config = EngineConfig(num_speculative_tokens=seen[1]["spec"], max_num_seqs=seen[1]["rows"])
    assert default_speculation_limit(config, seen[1]["rows"]) >= seen[1]["prompts"] == 8
