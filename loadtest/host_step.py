"""What the engine's own Python costs a decode step: `kvrelay bench host-step --batch 256 --out docs/results`.

On a GPU a decode step of a small model is mostly host time: at batch 256 on an H200 the host's work was ~3.4
ms of a 4.9 ms step while the device sat idle (docs/benchmarks.md). That work does not depend on the device,
so it is measured here, on any machine, with a tiny random-weight model (the default model's tokenizer, so
that detokenizing costs what it costs) whose forward pass is cheap: `--batch` requests decode together and
every decode-only step is split into its phases, each timed where the engine calls it:

- `schedule`: `Scheduler.schedule` (the token budget, KV slots);
- `step_inputs`: `build_step_inputs` (the flat batch, block tables, slot mapping, sampling specs), or
  `build_ahead_inputs` for a step queued ahead (`--async-scheduling`; none for one that advances the graph
  step before it on the device, `DecodeGraphs.advance`);
- `forward`: the model itself (device work on a GPU), or its CUDA graph's replay with the buffers' filling or
  advancing;
- `sample`: the sampler (`launch_sample`, or `launch_greedy` for plain greedy rows), its tensor ops and its
  per-row Python, and the wait for its copy back;
- `update`: `Scheduler.update_from_output` (tokens applied, stops, prefix-cache publishing);
- `outputs`: `OutputProcessor.process` (detokenizing, stop strings, `RequestOutput`s);
- `other`: the rest of `Engine.step`.

`host_ms` is the step less `forward` and `sample`: what a GPU would wait for on every step whatever its
speed. Beside the wall time, the thread's CPU time of the step and of its Python-only phases
(`thread_cpu_ms_per_step`): a phase whose CPU time falls short of its wall time had its thread off the CPU.
Configurations run in the same process; `--rounds` repeats the measurement and the median counts."""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.results import Timed, git_commit, loadavg, write_json

PHASES = ("schedule", "step_inputs", "forward", "sample", "update", "outputs")
CPU_PHASES = ("step_inputs", "update", "outputs")  # Python on the host alone, on any device
TOP_FUNCTIONS = 25
BLOCK_SIZE = 16  # the engine's default


class _GcClock:
    """The seconds the garbage collector spends in collections, and how many, by generation, while it runs."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._start = 0.0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1

    def __enter__(self) -> "_GcClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)



def write_model(path: Path, tokenizer_dir: str, vocab_size: int) -> str:
    """A one-layer random-weight Llama with the default model's tokenizer: a forward pass costs little
    beside the engine's bookkeeping (the LM head over the whole vocabulary stays)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


def host_only(engine: Any, batch: int) -> None:
    """The engine's host path of a GPU's decode steps, on the CPU: its forward pass replaced by one that returns
    fixed logits (each row's argmax its own token), and decode steps replayed from graphs by the eager
    stand-in (`eager_capture`) over the Triton backend's metadata, so that a step's inputs go where a CUDA
    graph's go, and steps queued ahead advance them (`DecodeGraphs.advance`). Forward and sample are then the
    graph's buffers and the argmax; the rest is the host's work as a GPU waits for it, less the kernels'
    launches."""
    import torch

    from workers.cuda_graphs import eager_capture

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, engine.vocab_size, generator=generator)
    # each row's token from the vocabulary's upper half: byte tokens (a BPE vocabulary's first 256) repeated
    # would leave a text that never completes a character, whose every step decodes a longer window
    half = engine.vocab_size // 2
    logits[torch.arange(batch), half + torch.arange(batch) * 7 % half] = 10.0

    def forward(input_ids, positions, meta, logits_indices):
        return logits[:logits_indices.shape[0]]

    engine.runner._forward = forward
    engine.runner.enable_decode_graphs(batch, engine.max_model_len, capture=eager_capture)


def _prompts(batch: int, length: int, vocab: int, first: int = 3) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(first, vocab) for _ in range(length)] for _ in range(batch)]


def measure(engine: Any, prompts: list[list[int]], steps: int, output_kind: Any, profile: bool = False,
            frequency_penalty: float = 0.0, bad_words: list[str] | None = None) -> dict:
    """Decode `steps` steps of the whole batch after its prefill; seconds per step by phase."""
    from loadtest.gpu_check.engines import all_decoding
    from workers import model_runner
    from workers.sampler import PendingSample
    from workers.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True, frequency_penalty=frequency_penalty,
                            bad_words=bad_words)
    tag = time.monotonic_ns()
    for i, ids in enumerate(prompts):
        engine.add_request(f"h{tag}-{i}", None, params, prompt_token_ids=ids, output_kind=output_kind)
    sched, runner, outputs = engine.scheduler, engine.runner, engine.outputs
    timers = {"schedule": Timed(sched.schedule), "step_inputs": Timed(model_runner.build_step_inputs),
              "forward": Timed(runner._forward), "sample": Timed(model_runner.launch_sample),
              "update": Timed(sched.update_from_output), "outputs": Timed(outputs.process)}
    # more timers in some phases: a step queued ahead builds its inputs apart; the sampler's wait; a batch of
    # plain greedy rows samples through `launch_greedy`
    ahead_inputs, wait, greedy = (Timed(model_runner.build_ahead_inputs), Timed(PendingSample.result),
                                  Timed(model_runner.launch_greedy))
    more = {"step_inputs": [ahead_inputs], "sample": [wait, greedy]}
    # the instances' own attributes before the timers (`host_only`'s forward), put back after
    patched = [(sched, "schedule"), (sched, "update_from_output"), (runner, "_forward"), (outputs, "process")]
    own = [(obj, name, vars(obj).get(name)) for obj, name in patched]
    sched.schedule, sched.update_from_output = timers["schedule"], timers["update"]
    runner._forward, outputs.process = timers["forward"], timers["outputs"]
    graphs = runner.graphs  # a decode step that replays a CUDA graph calls one of these instead of `_forward`
    if graphs is not None:
        graphs.run, graphs.advance = Timed(graphs.run), Timed(graphs.advance)

    def replayed() -> float:
        return graphs.run.seconds + graphs.advance.seconds if graphs is not None else 0.0
    model_runner.build_step_inputs, model_runner.launch_sample = timers["step_inputs"], timers["sample"]
    model_runner.build_ahead_inputs, model_runner.launch_greedy = ahead_inputs, greedy
    PendingSample.result = lambda pending: wait(pending)

    def seconds(phase: str) -> float:
        return timers[phase].seconds + sum(t.seconds for t in more.get(phase, ()))

    def cpu_seconds(phase: str) -> float:
        return timers[phase].cpu_seconds + sum(t.cpu_seconds for t in more.get(phase, ()))
    prof = cProfile.Profile() if profile else None
    walls: list[float] = []
    per_phase: dict[str, list[float]] = {k: [] for k in PHASES}
    # the thread's CPU time in the steps and in their Python-only phases: short of the wall time by what the
    # thread spent off the CPU (descheduled; a wait that sleeps)
    cpu_per_phase: dict[str, list[float]] = {k: [] for k in ("step", *CPU_PHASES)}
    schedules = 0  # steps that called the scheduler (with async scheduling, most run a step queued ahead)
    gc_s, gc_counts = 0.0, [0, 0, 0]
    clock = _GcClock()
    try:
        while engine.has_unfinished_requests():
            decoding = all_decoding(engine, len(prompts))
            if decoding and len(walls) >= steps:
                break
            before = {k: seconds(k) for k in timers}
            cpu_before = {k: cpu_seconds(k) for k in CPU_PHASES}
            scheduled = timers["schedule"].calls
            before["forward"] += replayed()
            if decoding and prof is not None:
                prof.enable()
            with clock:
                start, cpu_start = time.perf_counter(), time.thread_time()
                engine.step()
                wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
            if decoding and prof is not None:
                prof.disable()
            if decoding:
                walls.append(wall)
                gc_s += clock.seconds
                gc_counts = [a + b for a, b in zip(gc_counts, clock.collections)]
                schedules += timers["schedule"].calls > scheduled
                for k in PHASES:
                    per_phase[k].append(seconds(k) - before[k])
                cpu_per_phase["step"].append(cpu)
                for k in CPU_PHASES:
                    cpu_per_phase[k].append(cpu_seconds(k) - cpu_before[k])
                per_phase["forward"][-1] += replayed()
            clock.seconds, clock.collections = 0.0, [0, 0, 0]
    finally:
        for obj, name, value in own:
            if value is None:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        if graphs is not None:
            del graphs.run, graphs.advance
        model_runner.build_step_inputs, model_runner.launch_sample = timers["step_inputs"].fn, timers["sample"].fn
        model_runner.build_ahead_inputs, model_runner.launch_greedy = ahead_inputs.fn, greedy.fn
        PendingSample.result = wait.fn
        engine.abort_request(engine.unfinished_request_ids())
        while engine.has_unfinished_requests():
            engine.step()
    if not walls:
        raise RuntimeError(f"no decode-only step of all {len(prompts)} requests was measured")
    n = len(walls)
    ms = {k: 1e3 * sum(v) / n for k, v in per_phase.items()}
    ms["step"] = 1e3 * sum(walls) / n
    ms["other"] = ms["step"] - sum(ms[k] for k in PHASES)
    ms["host"] = ms["step"] - ms["forward"] - ms["sample"]
    ms["gc"] = 1e3 * gc_s / n  # inside whichever phases the collections fell in
    cpu_ms = {k: round(1e3 * sum(v) / n, 4) for k, v in cpu_per_phase.items()}
    result = {"decode_steps": len(walls), "scheduled_steps": schedules, "ms_per_step": {k: round(v, 4) for k, v in ms.items()},
              "thread_cpu_ms_per_step": cpu_ms, "gc_collections_by_generation": gc_counts}
    if prof is not None:
        stats = pstats.Stats(prof).stats
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:TOP_FUNCTIONS]
        result["profile_top_own_time"] = [
            {"function": f"{Path(f).name}:{line}({name})", "calls_per_step": round(calls / n, 1),
             "own_ms_per_step": round(1e3 * own / n, 4), "cumulative_ms_per_step": round(1e3 * cum / n, 4)}
            for (f, line, name), (_, calls, own, cum, _) in rows]
    return result


def run_host_step(args: argparse.Namespace) -> int:
    if min(args.batch, args.prompt_len, args.steps, args.rounds, args.threads) < 1:
        raise ValueError("--batch, --prompt-len, --steps, --rounds and --threads must be >= 1")
    from workers.engine import Engine
    from workers.gc_heap import freeze_startup_heap
    from workers.model_loader import default_model_path
    from workers.output_processor import OutputKind

    kind = OutputKind(args.output_kind)
    if args.host_only:
        if args.device != "cpu":
            raise ValueError("--host-only runs on the CPU (a GPU runs the model itself)")
        # the Triton backend's graph metadata, no Triton kernel: the forward pass is replaced (`host_only`)
        os.environ["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_model(Path(tmp), args.tokenizer or default_model_path(), args.vocab_size)
        max_model_len = args.prompt_len + args.steps + 64
        # room for the whole batch at its longest, whatever the model's layers (a fixed size left a real
        # model's batch preempting, never all decoding at once)
        engine = Engine(model=model, dtype=args.dtype, device=args.device, num_threads=args.threads,
                        max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch),
                        max_model_len=max_model_len, block_size=BLOCK_SIZE,
                        num_kv_blocks=args.batch * -(-max_model_len // BLOCK_SIZE) + 16,  # 16 to spare
                        num_speculative_tokens=0, async_scheduling=args.async_scheduling,
                        attention_backend="triton" if args.host_only else "auto")
        if args.host_only:
            host_only(engine, args.batch)
        frozen = freeze_startup_heap()  # as a replica's heap is once it has started (runs before 2026-12-07: not)
        # --host-only: prompts, like its tokens, from the vocabulary's upper half (whole characters: a prompt
        # ending inside one leaves the detokenizer its slower path, which text does not)
        prompts = _prompts(args.batch, args.prompt_len, engine.vocab_size,
                           engine.vocab_size // 2 if args.host_only else 3)
        sampling = {"frequency_penalty": args.frequency_penalty, "bad_words": args.bad_words}
        measure(engine, prompts[:8], 4, kind, **sampling)  # warm-up
        load = [loadavg()]
        rounds = []
        for r in range(args.rounds):
            rounds.append(measure(engine, prompts, args.steps, kind, **sampling))
            load.append(loadavg())
            print("round", r + 1, " ".join(f"{k} {v:.3f}" for k, v in rounds[-1]["ms_per_step"].items()),
                  "gc collections", rounds[-1]["gc_collections_by_generation"])
            print("  thread CPU ms:", " ".join(f"{k} {v:.3f}" for k, v in rounds[-1]["thread_cpu_ms_per_step"].items()))
        profiled = (measure(engine, prompts, args.steps, kind, profile=True, **sampling) if args.profile
                    else None)
    median = {k: round(statistics.median(r["ms_per_step"][k] for r in rounds), 4) for k in rounds[0]["ms_per_step"]}
    print(f"median ms per decode step at batch {args.batch}: " + ", ".join(f"{k} {v:.3f}" for k, v in median.items()))
    if profiled is not None:
        for row in profiled["profile_top_own_time"][:15]:
            print(f"  {row['own_ms_per_step']:8.3f} ms own {row['calls_per_step']:8.1f} calls  {row['function']}")
    payload = {"benchmark": "host-step", "command": "kvrelay bench " + " ".join(args.argv), "commit": git_commit(),
               "batch": args.batch, "prompt_len": args.prompt_len, "steps": args.steps, "rounds": args.rounds,
               "output_kind": kind.value, "frequency_penalty": args.frequency_penalty, "bad_words": args.bad_words,
               "async_scheduling": engine.async_scheduling, "dtype": args.dtype, "threads": args.threads, "device": str(engine.device),
               "model": args.model or f"random 1-layer Llama, vocab {args.vocab_size}", "host_only": args.host_only,
               "loadavg_1_5_15": load, "gc_frozen_objects": frozen,
               "median_ms_per_step": median, "per_round": rounds, "profiled_round": profiled}
    if args.out is not None:
        path = write_json(args.out / f"host-step-{time.strftime('%Y%m%d-%H%M%S')}.json", payload)
        print(f"wrote {path}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("host-step", help="the engine's own Python per decode step, by phase, with a tiny model")
    p.add_argument("--batch", type=int, default=256, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-kind", default="delta", choices=["delta", "cumulative", "final"],
                   help="how requests report (the server streams deltas)")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="the tiny model's vocabulary: its first ids of the default tokenizer's (a smaller LM head and "
                   "argmax than the real model's, whose cost is the device's on a GPU)")
    p.add_argument("--model", default=None, help="a model folder instead of the tiny random one")
    p.add_argument("--tokenizer", default=None, help="the folder whose tokenizer the tiny model takes (default: "
                   "the default model's; a GPU machine without it: the GPU check's prepared folder)")
    p.add_argument("--device", default="cpu", help="the engine's device: on cuda, forward and sample are the "
                   "kernels' launch and the wait for them, and host is what the GPU waits for")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="queue each decode step behind the one before (default: the engine's, on for one GPU)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="every request's (penalties read each request's token counts every step)")
    p.add_argument("--bad-words", nargs="+", default=None, metavar="WORD",
                   help="every request's bad words (their bans read each request's last tokens every step)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--profile", action="store_true", help="one more round under Python's profiler (not in the medians)")
    p.add_argument("--host-only", action="store_true", help="on the CPU, the host's path of a GPU's graph steps: "
                   "the forward pass replaced by fixed logits, decode steps replayed from graphs by a stand-in")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON result (default: print only)")


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtest.host_step ...`: the same as `kvrelay bench host-step`, without the rest of the
    bench's imports (a GPU machine without Ray or pydantic runs it)."""
    import sys

    parser = argparse.ArgumentParser(prog="python -m loadtest.host_step")
    add_parser(parser.add_subparsers(dest="workload", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["host-step", *argv])
    args.argv = ["host-step", *argv]
    return run_host_step(args)


if __name__ == "__main__":
    raise SystemExit(main())
