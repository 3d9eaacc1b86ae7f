"""The check's command line and driver: each section runs on its own, a failure is recorded and the rest go
on, and everything lands in `OUT/gpu_check.json` plus a printed summary. Only the standard library is
imported at module level, so `--dry-run` can set TRITON_INTERPRET before Triton loads."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_DIR = ".gpu_check/model"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.gpu_check", description=__doc__)
    p.add_argument("--prepare", metavar="DIR", help="write config.json and the tokenizer files into DIR and exit "
                   "(on a machine with the default model; carry DIR to the GPU machine)")
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="the prepared folder (random weights are written "
                   f"into it on first run); default: {DEFAULT_MODEL_DIR}")
    p.add_argument("--out", help="folder for gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, Triton interpreted, graphs "
                   "replayed eagerly: exercises every section here")
    p.add_argument("--only", metavar="SECTION,...", help="run only these sections (a rerun within a short lease); "
                   "the others are recorded as skipped")
    p.add_argument("--separate-kernels", action="store_true",
                   help="every section with each layer's norms, matmuls, rotary and SiLU in separate kernels (the "
                   "fused norm-and-matmul off, linear_sweep skipped): a rerun's fallback if the fused kernels fail "
                   "on a GPU; default: apart too, unless linear_sweep finds a fused config faster")
    args = p.parse_args(argv)
    if args.prepare is None and args.out is None:
        p.error("--out DIR is required (or --prepare DIR)")
    if args.only is not None:
        unknown = set(args.only.split(",")) - set(SECTIONS)
        if unknown:
            p.error(f"--only: unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


# the kernel variants Triton's JIT compiled (or found in its cache) in each section, for `aot_fidelity`
JIT_VARIANTS: dict[str, set] = {}


class _CompileClock:
    """Triton's compilations while it is installed (`knobs.compilation.listener`): how many kernels were compiled
    (not found in the cache) and the seconds they took, by kernel, so a lease knows what its JIT costs it; and
    every variant compiled or found (`kernels.triton_aot.compiled_variant`)."""

    def __init__(self) -> None:
        self.by_kernel: dict[str, list] = {}
        self.variants: set = set()

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        try:
            from kernels.triton_aot import compiled_variant

            self.variants.add(compiled_variant(src, metadata))
        except Exception:  # a listener must not break a launch
            pass
        if cache_hit:
            return
        name = getattr(getattr(src, "fn", None), "__name__", None) or str(metadata.get("name", "?"))
        seconds = (times.ir_initialization + times.total_lowering + times.store_results) / 1e6
        entry = self.by_kernel.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def __enter__(self) -> "_CompileClock":
        try:
            from triton import knobs
        except ImportError:
            return self
        self._knobs, self._before = knobs, knobs.compilation.listener
        knobs.compilation.listener = self
        return self

    def __exit__(self, *exc) -> None:
        if hasattr(self, "_knobs"):
            self._knobs.compilation.listener = self._before

    def report(self) -> dict:
        return {"compiled": sum(n for n, _ in self.by_kernel.values()), "variants_seen": len(self.variants),
                "seconds": round(sum(t for _, t in self.by_kernel.values()), 2),
                "by_kernel": {k: {"compiled": n, "seconds": round(t, 2)}
                              for k, (n, t) in sorted(self.by_kernel.items())}}


def _section(name: str, fn: Callable[[], dict], results: dict, on_done: Callable[[], None] | None = None) -> None:
    start = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    with _CompileClock() as clock:
        try:
            data = fn()
            status = data.pop("status", None) or ("passed" if data.get("passed") else "failed")
        except Exception as e:
            data, status = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}, "error"
    data = {"status": status, **data, "elapsed_s": round(time.perf_counter() - start, 2),
            "triton_compiles": clock.report()}
    JIT_VARIANTS[name] = clock.variants
    results[name] = data
    compiles = data["triton_compiles"]
    print(f"[gpu_check] {name}: {status} ({data['elapsed_s']} s; {compiles['compiled']} Triton kernels compiled in "
          f"{compiles['seconds']} s)", flush=True)
    if on_done is not None:
        on_done()


def environment() -> dict:
    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "capability": f"{props.major}.{props.minor}"}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:
        info["nccl"] = f"unavailable ({type(e).__name__})"
    return {"passed": True, **info}


def throughput(plan, model: str, vocab: int) -> dict:
    import torch

    from loadtest.gpu_check.plan import GRAPH_SPEEDUP_TARGET, ROOFLINE_TARGET
    from loadtest.gpu_check.throughput import batch1_decode, batch_throughput, copy_bandwidth
    from workers.config import EngineConfig

    bandwidth = copy_bandwidth(torch.device(plan.device), plan.copy_bytes)
    ahead = True if plan.dry_run else None  # the engine's default on a GPU; forced on for the dry run
    batch = {"graphs": batch_throughput(plan, model, vocab, True, bandwidth, overlap=True, ahead=ahead),
             "eager": batch_throughput(plan, model, vocab, False, bandwidth, overlap=True, ahead=ahead),
             # the A/B of async scheduling: each decode step queued once the one before is done
             "graphs_in_turn": batch_throughput(plan, model, vocab, True, bandwidth, overlap=True, ahead=False),
             # and of overlapped outputs: each step's outputs made before the next step
             "graphs_outputs_in_step": batch_throughput(plan, model, vocab, True, bandwidth, overlap=False,
                                                        ahead=False),
             # the engine's default speculation (4 n-gram drafts; with graphs none while more requests run than the
             # largest graph holds with theirs, so a full batch runs ahead) ...
             "graphs_speculating": batch_throughput(plan, model, vocab, True, bandwidth, overlap=True,
                                                    speculative_tokens=EngineConfig.num_speculative_tokens),
             # ... and drafts at any batch (steps of more rows than a graph run eagerly, and in turn)
             "graphs_drafting_always": batch_throughput(plan, model, vocab, True, bandwidth, overlap=True,
                                                        speculative_tokens=EngineConfig.num_speculative_tokens,
                                                        speculation_limit=plan.batch),
             # the default once more, last: whether a configuration's place in the order moves its step (the
             # first H100 run's two async runs, the same path at this batch, were 0.54 ms a step apart)
             "graphs_again": batch_throughput(plan, model, vocab, True, bandwidth, overlap=True, ahead=ahead)}
    single = {"graphs": batch1_decode(plan, model, vocab, True), "eager": batch1_decode(plan, model, vocab, False)}
    eager_tok_s = single["eager"]["decode_tok_s"]
    speedup = single["graphs"]["decode_tok_s"] / eager_tok_s if eager_tok_s else None
    fraction = batch["graphs"].get("roofline_fraction")
    targets = {"decode_roofline_fraction_with_graphs": {"value": fraction, "target": ROOFLINE_TARGET,
                                                         "met": fraction is not None and fraction >= ROOFLINE_TARGET},
               "batch1_graphs_over_eager": {"value": speedup, "target": GRAPH_SPEEDUP_TARGET,
                                            "met": speedup is not None and speedup >= GRAPH_SPEEDUP_TARGET}}
    measured = all(b.get("decode_only_steps") for b in batch.values()) and all(
        s["decode_steps"] for s in single.values())
    # A dry run on the CPU measures nothing meaningful: it only has to complete.
    met = all(t["met"] for t in targets.values()) or plan.dry_run
    return {"passed": measured and met, "targets_applied": not plan.dry_run, "targets": targets,
            "copy_bandwidth_gb_s": bandwidth / 1e9, "batch": batch, "batch1": single,
            "batch1_graphs_over_eager": speedup}


SECTIONS = ("triton_warmup", "environment", "kernel_parity", "greedy_cpu_vs_device", "greedy_graphs_on_vs_off",
            "greedy_speculative_vs_plain", "aot_fidelity", "attention_sweep", "linear_sweep", "throughput",
            "sync_audit", "decode_profile", "pd_handoff", "random_workload", "tensor_parallel")


# the sections whose engines launch the kernels with their default configs (before the sweeps change them)
ENGINE_SECTIONS = ("greedy_cpu_vs_device", "greedy_graphs_on_vs_off", "greedy_speculative_vs_plain")


def aot_fidelity(sections: tuple[str, ...]) -> dict:
    """Whether CI's ahead-of-time compile (`workers/kernel_variants.py`) covers what this GPU's JIT compiled: every
    variant the engines of `sections` launched (SmolLM2-135M's shape, float32 and bfloat16) must be among those
    the recording gives for that shape, as Triton's JIT specialized it here."""
    import torch

    from kernels.triton_aot import normalized
    from workers.kernel_variants import engine_variants

    seen = set().union(*(JIT_VARIANTS.get(s, set()) for s in sections))
    recorded = {normalized(v) for v in engine_variants(("smollm2-135m",), (torch.float32, torch.bfloat16))}
    missing = sorted(v.label() for v in seen - recorded)
    return {"passed": bool(seen) and not missing, "jit_variants": len(seen), "recorded_variants": len(recorded),
            "missing": missing[:20], "missing_count": len(missing), "sections": list(sections)}


def run_checks(plan, model_dir: Path, on_done: Callable[[dict], None] | None = None,
               only: set[str] | None = None, separate_kernels: bool = False) -> dict:
    """Every section in turn (or those in `only`; `environment` always runs); `on_done(results so far)` after
    each, so a run stopped at its time limit still leaves what it measured. `separate_kernels`: the fused
    norm-and-matmul off throughout (`triton_linear.NORM_LINEAR_CONFIG = None`), its sweep skipped."""
    from loadtest.gpu_check.model_files import write_weights

    write_weights(model_dir)
    model = str(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    import torch

    from loadtest.gpu_check import (attention_sweep, greedy_parity, linear_sweep, pd_handoff, profile,
                                    random_workload, sync_audit, tensor_parallel, warmup)
    from loadtest.gpu_check.kernel_parity import check_kernels
    from loadtest.gpu_check.plan import TOLERANCE

    device = torch.device(plan.device)
    results: dict = {}
    if separate_kernels:
        from kernels import triton_linear

        triton_linear.NORM_LINEAR_CONFIG = None

    def done() -> None:
        if on_done is not None:
            on_done(results)

    def section(name: str, fn: Callable[[], dict], why_not: str | None = None) -> None:
        """Run `fn` as section `name`, unless `--only` leaves it out or it cannot run here (`why_not`)."""
        if only is not None and name not in only and name != "environment":
            why_not = "not in --only"
        if why_not:
            results[name] = {"status": "skipped", "reason": why_not}
            done()
        else:
            _section(name, fn, results, done)

    section("triton_warmup", warmup.warm_triton_cache,
            "dry run: Triton's interpreter compiles nothing" if plan.dry_run else None)
    section("environment", environment)
    section("kernel_parity", lambda: check_kernels(device, plan.kernel_heads, plan.kernel_batch, TOLERANCE))
    section("greedy_cpu_vs_device", lambda: greedy_parity.cpu_vs_device(plan, model, vocab))
    section("greedy_graphs_on_vs_off", lambda: greedy_parity.graphs_on_vs_off(plan, model, vocab))
    section("greedy_speculative_vs_plain", lambda: greedy_parity.speculative_vs_plain(plan, model, vocab))
    section("aot_fidelity", lambda: aot_fidelity(ENGINE_SECTIONS),
            "dry run: Triton's interpreter compiles nothing" if plan.dry_run else None)
    section("attention_sweep", lambda: attention_sweep.sweep(plan))
    section("linear_sweep", lambda: linear_sweep.sweep(plan), "--separate-kernels" if separate_kernels else None)
    section("throughput", lambda: throughput(plan, model, vocab))
    section("sync_audit", lambda: sync_audit.audit(plan, model, vocab))
    section("decode_profile", lambda: profile.decode_profile(plan, model, vocab))
    section("pd_handoff", lambda: pd_handoff.check_pd(plan, model, vocab), pd_handoff.transport_available())
    section("random_workload", lambda: random_workload.check(plan, model))
    section("tensor_parallel", lambda: tensor_parallel.check_tp(plan, model_dir, vocab),
            tensor_parallel.why_skipped(plan))
    return results


def summary(report: dict) -> str:
    lines = [f"gpu_check ({report['mode']}) in {report['elapsed_s']:.0f} s: "
             f"{'ALL PASSED' if report['all_passed'] else 'FAILURES'}"]
    for name, data in report["checks"].items():
        extra = data.get("reason") or data.get("error") or ""
        lines.append(f"  {name:26s} {data['status']:8s} {extra}".rstrip())
    compiles = [d["triton_compiles"] for d in report["checks"].values() if "triton_compiles" in d]
    if compiles:
        lines.append(f"  Triton's JIT: {sum(c['compiled'] for c in compiles)} kernels compiled in "
                     f"{sum(c['seconds'] for c in compiles):.1f} s")
    aot = report["checks"].get("aot_fidelity", {})
    if "jit_variants" in aot:
        lines.append(f"  AOT fidelity: {aot['jit_variants']} variants compiled by the JIT, {aot['missing_count']} of "
                     f"them not among the {aot['recorded_variants']} recorded for CI")
    for name, state in report["checks"].get("kernel_parity", {}).get("optional_backends", {}).items():
        lines.append(f"  optional attention {name}: {state[:100]}")
    sw = report["checks"].get("attention_sweep", {})
    timed = sorted((r for r in sw.get("configs", []) if r.get("us")), key=lambda r: r["us"])
    for row in timed[:4] + [r for r in timed[4:] if r["config"] == sw.get("default")]:
        c = row["config"]
        lines.append(f"  decode attention block_n {c['block_n']} warps {c['num_warps']} stages {c['num_stages']} "
                     f"splits {c['num_splits']}{'' if c.get('prefetch', True) else ' no prefetch'}"
                     f"{' (default)' if c == sw.get('default') else ''}: "
                     f"{row['us']:.1f} us, {row['kv_gb_s']:.0f} GB/s ({row['of_copy_bandwidth']:.0%} of copy)")
    if sw.get("applied"):
        lines.append(f"  decode attention config applied for the sections after: {sw['applied']}")
    one = sw.get("one_sequence", {})
    if one.get("auto_splits_us"):
        applied = f" (applied: {'split' if one['auto_splits'] else 'unsplit'})" if one["applied"] else ""
        lines.append(f"  one sequence: {one['us']:.1f} us, split {one['splits']} ways {one['auto_splits_us']:.1f} us"
                     f"{applied}")
    for name in ("attention_sweep", "linear_sweep"):
        pdl = report["checks"].get(name, {}).get("pdl", {})
        for row in pdl.get("configs", [pdl]):
            what = f"  {name.split('_')[0]}{' plain' if row.get('config', {}).get('plain_matmuls') else ''}"
            if row.get("pdl_us"):
                lines.append(f"{what} with programmatic dependent launch: {row['pdl_us']:.1f} us, without "
                             f"{row['us']:.1f} us, outputs {'equal' if row['ok'] else 'DIFFER'}")
            elif row.get("error"):
                lines.append(f"{what} with programmatic dependent launch: {row['error'][:100]}")
        if pdl.get("applied"):
            lines.append(f"  {name.split('_')[0]}: applied for the sections after, after that A/B: "
                         f"{pdl.get('choice') or {**pdl['config'], 'pdl': pdl.get('pdl', True)}}")
    ls = report["checks"].get("linear_sweep", {})
    for rows, data in ls.get("rows", {}).items():
        fastest = sorted((r for r in data["configs"] if r.get("us")), key=lambda r: r["us"])[:3]
        best = ", ".join(f"{r['us']:.0f} us ({r['config']['block_m']}x{r['config']['block_n']}x{r['config']['block_k']}"
                         f" w{r['config']['num_warps']} s{r['config']['num_stages']}"
                         f"{' plain' if r['config']['plain_matmuls'] else ''})" for r in fastest)
        lines.append(f"  layers but attention x{ls['layers']}, {rows} rows: separate {data['separate_us']:.0f} us; "
                     f"fused {best}")
    if ls.get("applied") and not report["mode"] == "dry-run":
        lines.append(f"  fused norm+matmul config applied for the sections after: {ls['applied']}")
    small = ls.get("small_ops_pdl", {})
    if small.get("pdl_us"):
        lines.append(f"  separate kernels, the small ones with programmatic dependent launch: "
                     f"{small['pdl_us']:.0f} us, without {small['us']:.0f} us, "
                     f"outputs {'equal' if small['ok'] else 'DIFFER'}"
                     + (f" (applied: {'with' if small['pdl'] else 'without'})" if small.get("applied") else ""))
    elif small.get("error"):
        lines.append(f"  separate kernels, the small ones with programmatic dependent launch: {small['error'][:100]}")
    tp = report["checks"].get("throughput", {})
    for kind in ("graphs", "eager", "graphs_in_turn", "graphs_outputs_in_step", "graphs_speculating",
                 "graphs_drafting_always", "graphs_again"):
        b = tp.get("batch", {}).get(kind, {})
        if b:
            frac = b.get("roofline_fraction")
            step_ms, call_ms = b.get("decode_step_ms", float("nan")), b.get("decode_call_ms", float("nan"))
            lines.append(f"  batch {b['requests']} {kind}: {b['output_tok_s']:.0f} out tok/s, decode step "
                         f"{step_ms:.2f} ms (the call {call_ms:.2f}), roofline "
                         f"{'n/a' if frac is None else f'{frac:.0%}'}"
                         + (f", {b['kept_drafts']} of {b['draft_tokens']} drafts kept" if "draft_tokens" in b else "")
                         + (f", {b['advanced_steps']} steps advanced on the device" if b.get("advanced_steps") else ""))
            if b.get("graph_replay", {}).get("device_step_ms"):
                g = b["graph_replay"]
                lines.append(f"    its graph alone: {g['device_step_ms']:.2f} ms a replay at {g['context_tokens']} "
                             f"tokens of context, roofline {g['roofline_fraction']:.0%}")
    if tp.get("batch1"):
        g, e = tp["batch1"]["graphs"], tp["batch1"]["eager"]
        lines.append(f"  batch 1: graphs {g['decode_tok_s']:.0f} tok/s, eager {e['decode_tok_s']:.0f} tok/s, "
                     f"ratio {tp.get('batch1_graphs_over_eager') or 0:.2f}")
    audit = report["checks"].get("sync_audit", {})
    for batch, run in (("", audit), ("varied, ", audit.get("varied") or {})):
        for kind in ("decode", "other"):
            if run.get(kind) and audit.get("sync_debug_mode"):
                a = run[kind]
                lines.append(f"  synchronizing calls, {batch}{kind} steps: {a['synchronizing_calls']} in {a['steps']} "
                             f"steps" + "".join(f"\n    {s['calls']} x {s['site']}" for s in a["sites"][:4]))
    for run in report["checks"].get("decode_profile", {}).get("runs", []):
        if run.get("profiled_steps"):
            top = ", ".join(f"{k['name'][:40]} {k['ms_per_step']:.2f}" for k in run["top"][:3])
            lines.append(f"  profile batch {run['batch']} {'graphs' if run['graphs'] else 'eager'}: "
                         f"{run['wall_ms_per_step']:.2f} ms/step, device busy {run['device_busy_fraction']:.0%}, "
                         f"{run['kernels_per_step']:.0f} kernels; top: {top}")
        if run.get("host"):
            top = ", ".join(f"{f['function']} {f['own_ms_per_step']:.2f}" for f in run["host"]["top_own_time"][:4])
            lines.append(f"    host (own ms/step): {top}")
    for run in report["checks"].get("random_workload", {}).get("runs", []):
        d, s = run["decode_path"], run["speculating"]
        lines.append(f"  random workload seed {d['seed']}: {d['requests']} requests ({d['aborted']} aborted), "
                     f"{d['steps']} steps, {d['preemptions']} preemptions, {d['advanced_steps']} steps advanced "
                     f"({d['blocks_advanced']} new blocks); {d['mismatch_count']} requests differ from eager in turn")
        lines.append(f"    speculating, seed {s['seed']}: {s['requests']} requests ({s['aborted']} aborted), "
                     f"{s['steps']} steps, {s['drafts_kept']} of {s['drafts']} drafts kept, {s['steps_queued_ahead']} "
                     f"steps queued ahead, {s['preemptions']} preemptions; {s['mismatch_count']} requests differ")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.prepare is not None:
        from loadtest.gpu_check.model_files import prepare

        print(f"prepared {prepare(Path(args.prepare))}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    from loadtest.gpu_check.model_files import TINY_SHAPE, prepare
    from loadtest.gpu_check.plan import Plan

    start = time.perf_counter()
    if args.dry_run:
        plan, model_dir = Plan.dry(), prepare(out / "tiny-model", TINY_SHAPE)
    else:
        plan, model_dir = Plan.gpu(), Path(args.model)

    def write(checks: dict, complete: bool) -> dict:
        by_status: dict[str, list[str]] = {"passed": [], "failed": [], "error": [], "skipped": []}
        for name, data in checks.items():
            by_status.setdefault(data["status"], []).append(name)
        report = {"mode": "dry-run" if args.dry_run else "gpu", "model": str(model_dir), "argv": sys.argv[1:],
                  "complete": complete, "elapsed_s": time.perf_counter() - start,
                  "all_passed": complete and not by_status["failed"] and not by_status["error"], **by_status,
                  "checks": checks}
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        return report

    try:
        only = set(args.only.split(",")) if args.only else None
        checks = run_checks(plan, model_dir, on_done=lambda partial: write(partial, complete=False), only=only,
                            separate_kernels=args.separate_kernels)
    except Exception as e:  # the model folder itself: nothing else can run
        checks = {"setup": {"status": "error", "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-4000:]}}
    report = write(checks, complete=True)
    print(summary(report))
    print(f"wrote {out / 'gpu_check.json'}")
    return 0
