"""Where a step makes the host wait for the device. With async scheduling a decode step pays for the host's
work only if the host never waits for the device but once, for the step before's sampled ids (a CUDA event);
any other synchronizing call in a step (an `.item()`, a copy to pageable memory, a mask's `nonzero`) stalls
the step queued ahead and puts the host's whole step back on the device's path.

torch reports each synchronizing call it makes while its sync debug mode is on (`torch.cuda.set_sync_debug_mode`,
a warning "called a synchronizing CUDA operation" at the Python line that made it). The batch's run is audited
from its prefill to its end with the mode on: every synchronizing call counted by the kind of step it fell in,
with the lines that made them. It passes when the decode-only steps of the whole batch, the steps the throughput
target is about, made none. Waiting on an event is not such a call, so the wait the engine means to make does
not count. Then a batch of varied requests runs the same way (`varied`: penalties, whose sampling reads token
counts kept on the device and, in a step queued ahead, the token in flight; logit bias; `min_tokens`; bad
words, whose bans on the token in flight are compared with it on the device; seeded and unseeded sampling
with top-k, top-p and min_p; logprobs): its decode-only steps must make none either, and some must have been
queued ahead.

On the CPU there is no sync debug mode; `pageable_copies` stands in for the most common such call a step
could make unseen: a tensor made from host data straight on the device (`torch.tensor(values, device=...)`),
which on a GPU copies from pageable memory and waits for every kernel queued before it (the engine's
`penalties.device_tensor` goes through pinned memory instead). The GPU check's dry run audits with it."""

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


def pageable_copies() -> Callable[[int], None]:
    """A `set_mode` for the CPU: while on, each tensor made from host data with an explicit `device` (what on
    a GPU is a copy from pageable memory, which waits for the device) is reported as torch's sync debug mode
    reports a synchronizing call, a warning at the line that made it."""
    import torch
    from torch.overrides import TorchFunctionMode

    from_data = {torch.tensor, torch.as_tensor}

    class PageableCopies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in from_data and kwargs.get("device") is not None:
                warnings.warn(f"{func.__name__}(..., device=) from host data: on a GPU a {MESSAGE} "
                              "(a copy from pageable memory)", stacklevel=2)
            return func(*args, **kwargs)

    on: list = []

    def set_mode(mode: int) -> None:
        if mode and not on:
            on.append(PageableCopies())
            on[0].__enter__()
        elif not mode and on:
            on.pop().__exit__(None, None, None)

    return set_mode


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


VARIED_KINDS = [dict(frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.1),
                dict(logit_bias={11: 2.0, 12: -3.0}),
                dict(min_tokens=2, stop_token_ids=[13]),
                dict(temperature=0.8, top_k=20, top_p=0.9),
                dict(temperature=1.0, min_p=0.05),
                dict(logprobs=2),
                dict(bad_words=["the", " of the", "and"]),
                dict(temperature=0.7, frequency_penalty=0.3, seed=None)]


def varied(max_tokens: int, count: int) -> list[SamplingParams]:
    """`count` requests' params, each of `max_tokens` tokens (EOS ignored), cycling through every kind of
    sampling a step queued ahead handles (`VARIED_KINDS`): penalties, logit bias, a `min_tokens` ban, seeded
    top-k and top-p, min_p, logprobs, bad words of one and two tokens (their bans compared with the token in
    flight on the device), unseeded sampling with a penalty."""
    out = []
    for i in range(count):
        kw = {"temperature": 0.0, "seed": 1000 + i, **VARIED_KINDS[i % len(VARIED_KINDS)]}
        if kw["temperature"] == 0.0:
            kw.pop("seed")
        if kw.get("min_tokens"):  # its stop id banned for the first half
            kw["min_tokens"] = max(kw["min_tokens"], max_tokens // 2)
        out.append(SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))
    return out


def audit_run(engine: Engine, prompts: list[list[int]], max_tokens: int, set_mode: Callable[[int], None],
              params: list[SamplingParams] | None = None, prefix: str = "s") -> dict:
    """Run `prompts` to the end (greedy, or each with its `params`) with each step's synchronizing calls
    counted, by whether the step was decode-only over the whole batch (`decode_context`) or another (prefill,
    mixed, the batch's last steps as it ends)."""
    params = params or [greedy(max_tokens)] * len(prompts)
    queued = engine.steps_queued_ahead
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{prefix}{i}", None, p, prompt_token_ids=ids, output_kind=OutputKind.FINAL_ONLY)
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
    over its batch, after a warm-up that compiles the kernels, then over the varied batch. `set_mode`: torch's
    sync debug mode; on the CPU, where there is none, copies from pageable memory stand in (`pageable_copies`)."""
    cuda = plan.device == "cuda"
    if set_mode is None:
        set_mode = _cuda_sync_mode if cuda else pageable_copies()
    batch = max(plan.batch, len(VARIED_KINDS))  # (the dry run's 2 would not hold every kind)
    engine = make_engine(plan, model, "bfloat16", plan.device, "triton", True, max_num_seqs=batch,
                         async_scheduling=None if cuda else True)
    generate(engine, random_prompts(plan.batch, plan.prompt_len, vocab, seed=9), greedy(plan.warmup_tokens), prefix="w")
    steps = audit_run(engine, random_prompts(plan.batch, plan.prompt_len, vocab, seed=5), plan.output_len, set_mode)
    mixed = audit_run(engine, random_prompts(batch, plan.prompt_len, vocab, seed=6), plan.output_len + 2, set_mode,
                      varied(plan.output_len + 2, batch), prefix="v")
    result = {"async_scheduling": engine.async_scheduling, "sync_debug_mode": cuda,
              "checked": "torch's sync debug mode" if cuda else "copies from pageable memory (the CPU's stand-in)",
              **steps, "varied": mixed}
    del engine
    release_memory()
    clean = all(run["decode"]["steps"] > 0 and run["decode"]["synchronizing_calls"] == 0 for run in (steps, mixed))
    return {"passed": clean and mixed["steps_queued_ahead"] > 0, **result}
