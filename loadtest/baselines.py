"""Hugging Face ``generate`` baselines: naive (one at a time) and static batching.

Both ignore arrival times (every request is assumed queued at t=0) and force
exact output lengths with ``min_new_tokens == max_new_tokens`` and greedy decoding.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch

from loadtest.results import RunResult
from loadtest.workloads import BenchRequest


def load_hf_model(path: str, dtype: str = "auto") -> Any:
    """Load ``AutoModelForCausalLM`` in eval mode, using every CPU core, in `dtype` as the engine reads it
    (`auto`: the engine's choice for this CPU)."""
    from transformers import AutoModelForCausalLM

    from workers.model_loader import resolve_dtype

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, "cpu"))
    model.eval()
    return model


def pad_token_id(model: Any) -> int:
    """Pad id from the generation config, model config, or EOS; 0 as a last resort."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(cfg, name, None) if cfg is not None else None
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    return 0


@torch.inference_mode()
def _generate_batch(model: Any, batch: Sequence[BenchRequest], pad_id: int) -> list[list[int]]:
    """Left-pad ``batch``, run it to its longest output, return each request's own tokens."""
    width = max(len(r.prompt_token_ids) for r in batch)
    new_tokens = max(r.output_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[row, width - n :] = 1
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
    )
    gen = out[:, width:]
    if gen.shape[1] != new_tokens:
        raise RuntimeError(f"generate produced {gen.shape[1]} tokens, expected {new_tokens}")
    return [gen[row, : r.output_len].tolist() for row, r in enumerate(batch)]


def hf_static(model: Any, requests: Sequence[BenchRequest], batch_size: int, progress: bool = False) -> RunResult:
    """Static batching: fixed batches in arrival order, each run until its longest member ends."""
    from tqdm import tqdm

    pad_id, outputs, generated = pad_token_id(model), [], 0
    t0 = time.perf_counter()
    starts = range(0, len(requests), batch_size)
    desc = "hf-naive" if batch_size == 1 else f"hf-static-{batch_size}"
    for start in tqdm(starts, desc=desc, unit="batch", disable=not progress, leave=False):
        batch = requests[start : start + batch_size]
        outputs += _generate_batch(model, batch, pad_id)
        generated += len(batch) * max(r.output_len for r in batch)
    wall = time.perf_counter() - t0
    return RunResult(
        system=f"hf-static-{batch_size}", num_requests=len(requests), wall_s=wall,
        useful_tokens=sum(len(o) for o in outputs), generated_tokens=generated,
        extra={"batch_size": batch_size},
        token_ids=outputs,
    )


def hf_naive(model: Any, requests: Sequence[BenchRequest], progress: bool = False) -> RunResult:
    """Naive serving: one request at a time through ``generate``."""
    result = hf_static(model, requests, batch_size=1, progress=progress)
    result.system = "hf-naive"
    result.extra = {}
    return result


def warmup_hf(model: Any) -> None:
    """One tiny untimed ``generate`` call so lazy initialisation is not measured."""
    _generate_batch(model, [BenchRequest([1, 2, 3, 4], 2), BenchRequest([5, 6], 2)], pad_token_id(model))
