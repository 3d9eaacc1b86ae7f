"""Where a step makes the host wait for the device. With async scheduling a decode step pays for the host's
work only if the host never waits for the device but once, for the step before's sampled ids (a CUDA event);
any other synchronizing call in a step (an `.item()`, a copy to pageable memory, a mask's `nonzero`) stalls
the step queued ahead and puts the host's whole step back on the device's path.

torch reports each synchronizing call it makes while its sync debug mode is on (`torch.cuda.set_sync_debug_mode`,
a warning "called a synchronizing CUDA operation" at the Python line that made it). The batch's run is audited
from its prefill to its end with the mode on: every synchronizing call counted by the kind of step it fell in,
with the lines that made them. It passes when the decode-only steps of the whole batch, the steps the throughput
target is about, made none. Waiting on an event is not such a call, so the wait the engine means to make does
not count. Then a batch of penalized requests (frequency, presence and repetition penalties: their sampling
reads token counts kept on the device, and in a step queued ahead the token in flight) runs the same way: its
decode-only steps must make none either, and some must have been queued ahead."""

from __future__ import annotations

import linecache
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from loadtest.gpu_check.engines import (decode_context, generate, greedy, make_engine, random_prompts,
                                        release_memory)
from loadtest.gpu_check.plan import Plan
from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.sampling_params import SamplingParams

MESSAGE = "synchronizing CUDA operation"
ROOT = Path(__file__).resolve().parents[2]
TOP_SITES = 10


def _site(w: warnings.WarningMessage) -> str:
    """The line that made the call: `file:line  source`, the file relative to the project where it is in it."""
    path = Path(w.filename)
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    return f"{name}:{w.lineno}  {linecache.getline(w.filename, w.lineno).strip()[:100]}"


def _cuda_sync_mode(mode: int) -> None:
    import torch

    torch.cuda.set_sync_debug_mode(mode)


@contextmanager
def synchronizing_calls(set_mode: Callable[[int], None]) -> Iterator[list[warnings.WarningMessage]]:
    """Every synchronizing call reported while inside (torch's sync debug mode at "warn", through `set_mode`);
    each occurrence is kept, not only a line's first."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_mode(1)
        try:
            seen: list[warnings.WarningMessage] = []
            yield seen
        finally:
            set_mode(0)
    seen.extend(w for w in caught if MESSAGE in str(w.message))


def penalized(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, frequency_penalty=0.5,
                          presence_penalty=0.2, repetition_penalty=1.1)


def audit_run(engine: Engine, prompts: list[list[int]], max_tokens: int,
              set_mode: Callable[[int], None], params: SamplingParams | None = None, prefix: str = "s") -> dict:
    """Run `prompts` to the end (greedy, or with `params`) with each step's synchronizing calls counted, by
    whether the step was decode-only over the whole batch (`decode_context`) or another (prefill, mixed, the
    batch's last steps as it ends)."""
    params = params or greedy(max_tokens)
    queued = engine.steps_queued_ahead
    for i, ids in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", None, params, prompt_token_ids=ids, output_kind=OutputKind.FINAL_ONLY)
    kinds = {"decode": {"steps": 0, "calls": 0, "sites": Counter()},
             "other": {"steps": 0, "calls": 0, "sites": Counter()}}
    while engine.has_unfinished_requests():
        kind = kinds["decode" if decode_context(engine, len(prompts)) is not None else "other"]
        with synchronizing_calls(set_mode) as calls:
            engine.step()
        kind["steps"] += 1
        kind["calls"] += len(calls)
        kind["sites"].update(_site(w) for w in calls)
    return {"steps_queued_ahead": engine.steps_queued_ahead - queued,
            **{name: {"steps": k["steps"], "synchronizing_calls": k["calls"],
                      "calls_per_step": k["calls"] / k["steps"] if k["steps"] else None,
                      "sites": [{"site": s, "calls": n} for s, n in k["sites"].most_common(TOP_SITES)]}
               for name, k in kinds.items()}}


def audit(plan: Plan, model: str, vocab: int, set_mode: Callable[[int], None] | None = None) -> dict:
    """The throughput section's default engine (graphs; async scheduling as on a GPU, forced on in the dry run)
    over its batch, after a warm-up that compiles the kernels. `set_mode`: torch's sync debug mode; on the CPU,
    where there is none, nothing is reported and the dry run only walks the steps."""
    cuda = plan.device == "cuda"
    if set_mode is None:
        set_mode = _cuda_sync_mode if cuda else (lambda mode: None)
    engine = make_engine(plan, model, "bfloat16", plan.device, "triton", True, max_num_seqs=plan.batch,
                         async_scheduling=None if cuda else True)
    generate(engine, random_prompts(plan.batch, plan.prompt_len, vocab, seed=9), greedy(plan.warmup_tokens), prefix="w")
    steps = audit_run(engine, random_prompts(plan.batch, plan.prompt_len, vocab, seed=5), plan.output_len, set_mode)
    pen = audit_run(engine, random_prompts(plan.batch, plan.prompt_len, vocab, seed=6), plan.output_len, set_mode,
                    penalized(plan.output_len), prefix="p")
    result = {"async_scheduling": engine.async_scheduling, "sync_debug_mode": cuda, **steps, "penalized": pen}
    del engine
    release_memory()
    clean = all(run["decode"]["steps"] > 0 and run["decode"]["synchronizing_calls"] == 0 for run in (steps, pen))
    return {"passed": clean and pen["steps_queued_ahead"] > 0, **result}
