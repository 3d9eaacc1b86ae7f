"""Rooflines of a benchmark run, from the ceilings measured in the same run (loadtest/ceilings.py):

- compute: the workload's FLOPs (2 x layer weights per token through the layers, 2 x LM head per sampled
  token, causal attention) over the measured matmul rate at the model's shapes gives the least time the run
  could take; the run's fraction is that time over its measured duration.
- memory (decode): one decode step of one stream reads every weight and the KV cache of its context, so one
  stream decodes at most bandwidth / those bytes tokens per second; the run's fraction is its per-stream decode
  rate (1 / median TPOT) over that ceiling.
- lockstep (both): the least time of a step-by-step engine given every request at once, that prefills every
  prompt at the matmul rates, then decodes every unfinished request in each step, a step taking the longer of
  its FLOPs at those rates and its reads (every weight once, each request's K and V) at the read bandwidth.
  Its ratio to the compute roofline's least time is the most of the compute roofline such an engine can reach
  on the host: where decode steps are bound by memory, well under 1.

Every run gets both where its metrics allow; `BOUNDS` names the one each workload is judged by."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from loadtest.ceilings import Ceilings
from loadtest.model_shape import ModelShape

BOUNDS = {"burst": "compute", "random": "compute", "poisson": "memory", "single": "memory"}


@dataclass(frozen=True, slots=True)
class WorkloadFlops:
    layers: float
    lm_head: float
    attention: float

    @property
    def total(self) -> float:
        return self.layers + self.lm_head + self.attention


def workload_flops(shape: ModelShape, lengths: Iterable[tuple[int, int]]) -> WorkloadFlops:
    """FLOPs of requests given as (prompt tokens, output tokens): each runs prompt + output - 1 tokens through
    the layers (the last sampled token is never fed back), the LM head once per output token, and causal
    attention in which the token at position i reads i + 1 keys (QK and PV: 4 x heads x head_dim each)."""
    through = [max(0, p + o - 1) for p, o in lengths]
    outputs = sum(o for _, o in lengths)
    attention_per_key = 4 * shape.num_heads * shape.head_dim * shape.num_layers
    return WorkloadFlops(layers=2.0 * shape.layer_params * sum(through),
                         lm_head=2.0 * shape.lm_head.params * outputs,
                         attention=float(attention_per_key * sum(t * (t + 1) // 2 for t in through)))


def compute_seconds(flops: WorkloadFlops, ceilings: Ceilings) -> float:
    """Least time for ``flops`` at the measured rates: the layers' matmul mix (also used for attention) and
    the LM head's."""
    return (flops.layers + flops.attention) / (ceilings.layer_gflops * 1e9) + flops.lm_head / (ceilings.lm_head_gflops * 1e9)


def decode_context(lengths: Sequence[tuple[int, int]]) -> float:
    """Mean context length a decoded token reads: prompt + half the output, weighted by output tokens."""
    outputs = sum(o for _, o in lengths)
    return sum(o * (p + o / 2) for p, o in lengths) / outputs if outputs else 0.0


def decode_bytes_per_token(shape: ModelShape, context: float, dtype_bytes: int) -> float:
    """Bytes one decode step of one stream reads: every weight, and K and V of ``context`` positions."""
    return (shape.weight_params + shape.kv_elements_per_position * context) * dtype_bytes


@dataclass(frozen=True, slots=True)
class LockstepBound:
    """The lockstep engine's least time (module docstring), in parts."""

    prefill_seconds: float
    decode_steps: int
    decode_compute_seconds: float  # the decode steps' FLOPs at the matmul rates
    decode_memory_seconds: float  # their reads at the read bandwidth
    decode_seconds: float  # the sum over steps of the longer of the two

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def lockstep_bound(shape: ModelShape, ceilings: Ceilings, lengths: Sequence[tuple[int, int]]) -> LockstepBound:
    """Least time of requests given as (prompt tokens, output tokens), all present at the start, for an engine that
    prefills every prompt (the layers, causal attention, the LM head for each first token), then runs decode step
    j = 1, 2, ... on every request with more than j output tokens: one token each through the layers at context
    prompt + j and the LM head; the step reads every weight and those contexts' K and V. Requests without output
    tokens are left out. Counted this way the FLOPs are those of `workload_flops`."""
    kept = [(p, o) for p, o in lengths if o >= 1]
    if not kept:
        return LockstepBound(0.0, 0, 0.0, 0.0, 0.0)
    prompts = np.array([p for p, _ in kept], dtype=np.float64)
    outputs = np.array([o for _, o in kept], dtype=np.int64)
    layer_rate, head_rate = ceilings.layer_gflops * 1e9, ceilings.lm_head_gflops * 1e9
    per_token, head = 2.0 * shape.layer_params, 2.0 * shape.lm_head.params
    per_key = 4.0 * shape.num_heads * shape.head_dim * shape.num_layers
    prefill = ((per_token * prompts.sum() + per_key * (prompts * (prompts + 1) / 2).sum()) / layer_rate
               + head * len(kept) / head_rate)
    # step j's requests are those with more than j outputs: with outputs sorted, a suffix of them
    order = np.argsort(outputs, kind="stable")
    sorted_outputs = outputs[order]
    suffix_prompts = np.concatenate([np.cumsum(prompts[order][::-1])[::-1], [0.0]])
    steps = np.arange(1, int(sorted_outputs[-1]), dtype=np.int64)
    first = np.searchsorted(sorted_outputs, steps, side="right")
    active = (len(kept) - first).astype(np.float64)
    keys = suffix_prompts[first] + steps * active  # keys read: prompt + j for each active request
    compute = (per_token * active + per_key * keys) / layer_rate + head * active / head_rate
    memory = (shape.weight_params + shape.kv_elements_per_position * keys) * ceilings.dtype_bytes / (ceilings.read_gbs * 1e9)
    return LockstepBound(prefill_seconds=float(prefill), decode_steps=len(steps),
                         decode_compute_seconds=float(compute.sum()), decode_memory_seconds=float(memory.sum()),
                         decode_seconds=float(np.maximum(compute, memory).sum()))


@dataclass(slots=True)
class Roofline:
    bound: str  # "compute" or "memory": the fraction this run is judged by
    flops: float
    attention_flops: float
    compute_seconds: float
    achieved_gflops: float
    compute_fraction: float | None
    decode_context: float
    bytes_per_token: float
    decode_ceiling_tok_s: float
    decode_tok_s: float | None
    decode_fraction: float | None
    lockstep_seconds: float
    lockstep_fraction: float | None  # lockstep_seconds / the run's duration
    attainable_compute_fraction: float | None  # compute_seconds / lockstep_seconds
    lockstep_decode_memory_seconds: float

    @property
    def fraction(self) -> float | None:
        return self.compute_fraction if self.bound == "compute" else self.decode_fraction

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "fraction": self.fraction}


def run_roofline(shape: ModelShape, ceilings: Ceilings, lengths: Sequence[tuple[int, int]], duration_s: float,
                 median_tpot_ms: float | None, bound: str) -> Roofline:
    """Both rooflines of one run of requests ``lengths`` that took ``duration_s``; the decode fraction only
    when the run timed its tokens (``median_tpot_ms`` > 0)."""
    if bound not in ("compute", "memory"):
        raise ValueError(f"bound must be 'compute' or 'memory', got {bound!r}")
    flops = workload_flops(shape, lengths)
    least_s = compute_seconds(flops, ceilings)
    context = decode_context(lengths)
    per_token = decode_bytes_per_token(shape, context, ceilings.dtype_bytes)
    ceiling_tok_s = ceilings.read_gbs * 1e9 / per_token
    decode_tok_s = 1000.0 / median_tpot_ms if median_tpot_ms else None
    lockstep = lockstep_bound(shape, ceilings, lengths)
    return Roofline(bound=bound, flops=flops.total, attention_flops=flops.attention, compute_seconds=least_s,
                    achieved_gflops=flops.total / duration_s / 1e9 if duration_s > 0 else 0.0,
                    compute_fraction=least_s / duration_s if duration_s > 0 and lengths else None,
                    decode_context=context, bytes_per_token=per_token, decode_ceiling_tok_s=ceiling_tok_s,
                    decode_tok_s=decode_tok_s,
                    decode_fraction=decode_tok_s / ceiling_tok_s if decode_tok_s is not None else None,
                    lockstep_seconds=lockstep.seconds,
                    lockstep_fraction=lockstep.seconds / duration_s if duration_s > 0 and lengths else None,
                    attainable_compute_fraction=least_s / lockstep.seconds if lockstep.seconds > 0 else None,
                    lockstep_decode_memory_seconds=lockstep.decode_memory_seconds)


def lengths_of_requests(requests: Iterable[Any]) -> list[tuple[int, int]]:
    """(prompt, output) tokens of workload requests (``BenchRequest``), for runs that generate all of them."""
    return [(len(r.prompt_token_ids), r.output_len) for r in requests]


def lengths_of_results(results: Iterable[Any]) -> list[tuple[int, int]]:
    """(prompt, output) tokens of the requests that succeeded (``RequestResult``)."""
    return [(r.prompt_tokens, r.output_tokens) for r in results if r.success]


@dataclass(slots=True)
class RunRooflines:
    """The model and the ceilings of one bench run; ``annotate`` adds ``run["roofline"]`` to a result record."""

    shape: ModelShape
    ceilings: Ceilings

    def annotate(self, run: dict[str, Any], lengths: Sequence[tuple[int, int]]) -> dict[str, Any]:
        m = run["metrics"]
        tpot = m.get("median_tpot_ms") if run.get("samples", {}).get("ttft") else None
        run["roofline"] = run_roofline(self.shape, self.ceilings, lengths, m["duration"], tpot,
                                       BOUNDS.get(run["workload"], "compute")).to_json()
        return run
