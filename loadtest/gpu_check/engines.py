"""Building engines for the check and running batches of token prompts through them to the end."""

from __future__ import annotations

import gc
import random

import torch

from loadtest.gpu_check.plan import Plan
from workers.config import EngineConfig
from workers.engine import Engine
from workers.gc_heap import freeze_startup_heap
from workers.output_processor import OutputKind
from workers.sampling_params import SamplingParams


def make_engine(plan: Plan, model: str, dtype: str, device: str, backend: str, graphs: bool,
                max_num_seqs: int = 256, speculative_tokens: int = 0, in_step_outputs: bool = False,
                async_scheduling: bool | None = None, speculation_limit: int | None = None) -> Engine:
    """An engine on `device`; `graphs` captures decode graphs (CUDA graphs on a GPU, replayed eagerly on
    the CPU through `eager_capture`, which needs the triton backend). Speculation is off unless asked for,
    so the throughput sections measure plain decode steps against the roofline."""
    config = EngineConfig(model=model, dtype=dtype, device=device, attention_backend=backend,
                          enforce_eager=not graphs, max_model_len=plan.max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=2048, kv_cache_memory=plan.kv_cache_memory,
                          num_speculative_tokens=speculative_tokens, disable_async_output_proc=in_step_outputs,
                          async_scheduling=async_scheduling, speculative_disable_by_batch_size=speculation_limit)
    engine = Engine(config)
    if graphs and engine.device.type == "cpu":
        from workers.cuda_graphs import eager_capture

        engine.runner.enable_decode_graphs(max_num_seqs, engine.max_model_len, capture=eager_capture)
    freeze_startup_heap()  # as a replica's heap is once it has started (`release_memory` thaws it)
    return engine


def release_memory() -> None:
    """Return a dropped engine's device memory before the next one sizes its cache; the heap an engine froze
    (`workers.gc_heap`) is thawed first, so that a reference cycle in what was dropped goes too."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams, prefix: str = "r") -> list[list[int]]:
    """Every prompt's output tokens, in prompt order."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", None, params, prompt_token_ids=ids, output_kind=OutputKind.FINAL_ONLY)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"{prefix}{i}"] for i in range(len(prompts))]


def decode_context(engine: Engine, batch: int) -> int | None:
    """The tokens of context the step about to run reads if it is decode-only over the whole batch (`batch`
    requests running, none waiting, each owing just its last token), else None; one pass over the requests,
    since the throughput section runs it between the steps it times."""
    s = engine.scheduler
    if len(s.running) != batch or s.num_waiting:
        return None
    total = 0
    for r in s.running:
        n = r.num_tokens
        if r.num_computed_tokens != n - 1:
            return None
        total += n
    return total


def all_decoding(engine: Engine, batch: int) -> bool:
    """Whether the step about to run is decode-only over the whole batch (`decode_context`)."""
    return decode_context(engine, batch) is not None


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
