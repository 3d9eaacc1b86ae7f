"""What structured outputs cost a step: decode steps of one batch with none, half or all of its rows under
a grammar, in-process, configurations interleaved round by round so that the machine's load hits them
alike; plus the time spent in the grammar hooks themselves (bitmask fill, masking, matcher advance).

`kvrelay bench structured --out docs/results`. Every row decodes exactly `--tokens` tokens (min_tokens =
max_tokens, so EOS is banned for all of them alike and a grammar can never end early); the constrained
rows follow a regex over words and punctuation that never has to end."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from loadtest.results import Timed, git_commit, loadavg, write_json

REGEX = r"[A-Za-z0-9 ,.;:'()\n-]+"
CONFIGS = {"none": 0.0, "half": 0.5, "all": 1.0}



def _run_batch(llm: Any, prompts: list[list[int]], share: float, tokens: int) -> dict[str, float]:
    """One batch to the end; the mean time of its decode-only steps and of the grammar hooks per step."""
    from workers import sampler
    from workers.output_processor import OutputKind
    from workers.sampling_params import SamplingParams
    from workers.structured_params import StructuredOutputsParams

    engine = llm.engine
    n_constrained = round(share * len(prompts))
    for i, ids in enumerate(prompts):
        so = StructuredOutputsParams(regex=REGEX) if i < n_constrained else None
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0, structured_outputs=so)
        engine.add_request(f"s{time.monotonic_ns()}-{i}", None, params, prompt_token_ids=ids,
                           output_kind=OutputKind.FINAL_ONLY)
    fill, accept = Timed(engine.structured.bitmask), Timed(engine.structured.accept)
    mask = Timed(sampler.apply_token_bitmask)
    engine.structured.bitmask, engine.structured.accept = fill, accept
    sampler.apply_token_bitmask = mask
    steps: list[float] = []
    hooks: list[float] = []
    try:
        while engine.has_unfinished_requests():
            decode_only = all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running) and \
                len(engine.scheduler.running) == len(prompts)
            before = fill.seconds + accept.seconds + mask.seconds
            start = time.perf_counter()
            engine.step()
            if decode_only:
                steps.append(time.perf_counter() - start)
                hooks.append(fill.seconds + accept.seconds + mask.seconds - before)
    finally:
        del engine.structured.bitmask, engine.structured.accept
        sampler.apply_token_bitmask = mask.fn
    return {"step_s": statistics.mean(steps), "hooks_s": statistics.mean(hooks), "decode_steps": len(steps)}


def run_structured(args: argparse.Namespace) -> int:
    from serving.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, kv_cache_memory="512MiB")
    tok = llm.tokenizer
    text = "Write a long story about a lighthouse keeper and the sea, in plain words. " * 8
    base = tok(text).input_ids[:args.prompt_len]
    prompts = [base[i % 7:] + base[:i % 7] for i in range(args.batch)]
    _run_batch(llm, prompts[:4], 0.5, 4)  # warm-up: compiles the grammar, fills caches
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in CONFIGS}
    load = [loadavg()]
    for _ in range(args.rounds):
        for name, share in CONFIGS.items():
            rounds[name].append(_run_batch(llm, prompts, share, args.tokens))
        load.append(loadavg())
    summary = {}
    base_step = statistics.median(r["step_s"] for r in rounds["none"])
    for name in CONFIGS:
        step = statistics.median(r["step_s"] for r in rounds[name])
        hooks = statistics.median(r["hooks_s"] for r in rounds[name])
        summary[name] = {"median_step_ms": round(step * 1e3, 3), "median_hooks_ms": round(hooks * 1e3, 4),
                         "step_vs_none_pct": round(100 * (step / base_step - 1), 2),
                         "hooks_pct_of_step": round(100 * hooks / step, 2)}
        print(f"{name:>5}: step {step * 1e3:8.2f} ms ({summary[name]['step_vs_none_pct']:+.1f}% vs none), grammar "
              f"hooks {hooks * 1e3:.3f} ms ({summary[name]['hooks_pct_of_step']:.2f}% of the step)")
    payload = {"benchmark": "structured", "command": "kvrelay bench " + " ".join(args.argv), "commit": git_commit(),
               "regex": REGEX, "batch": args.batch, "prompt_len": args.prompt_len, "tokens": args.tokens,
               "rounds": args.rounds, "dtype": args.dtype, "device": str(llm.engine.device),
               "loadavg_1_5_15": load, "summary": summary, "per_round": rounds}
    path = write_json(args.out / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json", payload)
    print(f"wrote {path}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("structured", help="decode step time with none, half or all of a batch under a grammar")
    p.add_argument("--batch", type=int, default=32, help="sequences in the batch")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--tokens", type=int, default=32, help="tokens each sequence decodes")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three configurations, interleaved")
    p.add_argument("--model", default=None, help="model folder (default: the engine's default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for the JSON result")
