"""Train the output-length predictor behind `--scheduling-policy predicted`.

Data: prompts drawn exactly as the `poisson` workload draws them (same seeds, extended past its 100
requests), each generated greedily by our engine with `max_tokens` = 384 (the workload's cap) and
*without* `ignore_eos`, so the length is where the model stops by itself. The workload's own 100
prompts are held out for evaluation; the model is fitted on the rest.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from loadtest.workloads import POISSON_OUTPUT_CAP, poisson_requests
from workers.length_predictor import LinearLengthPredictor, fit_ridge, prompt_features

NUM_HELD_OUT = 100  # the poisson workload's own requests
L2_GRID = (0.01, 0.1, 1.0, 10.0, 100.0)
DEFAULT_PREDICTOR = Path(__file__).resolve().parent / "data" / "length_predictor.json"


def collect_lengths(llm: Any, tokenizer: Any, num_prompts: int) -> dict[str, Any]:
    """Natural output lengths of the first ``num_prompts`` poisson-style prompts (greedy, EOS honoured)."""
    from serving import SamplingParams

    prompts = [r.prompt_token_ids for r in poisson_requests(tokenizer, 1.0, num_requests=num_prompts)]
    params = SamplingParams(max_tokens=POISSON_OUTPUT_CAP, temperature=0.0)
    t0 = time.perf_counter()
    outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=True)
    return {
        "prompts": [list(p) for p in prompts],
        "lengths": [len(o.outputs[0].token_ids) for o in outputs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
        "max_tokens": POISSON_OUTPUT_CAP,
        "seconds": time.perf_counter() - t0,
    }


def error_stats(pred: Sequence[float], true: Sequence[float]) -> dict[str, float]:
    """MAE, RMSE and Spearman rank correlation (the scheduler only uses the order)."""
    p, t = np.asarray(pred, dtype=float), np.asarray(true, dtype=float)
    stats = {"mae": float(np.mean(np.abs(p - t))), "rmse": float(np.sqrt(np.mean((p - t) ** 2)))}
    stats["spearman"] = _spearman(p, t)
    return stats


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return 0.0
    ra, rb = _ranks(a), _ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size, dtype=float)
    ranks[order] = np.arange(x.size, dtype=float)
    for value in np.unique(x):
        tie = x == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def choose_l2(features: np.ndarray, targets: np.ndarray, folds: int = 5, seed: int = 0) -> float:
    """The ridge penalty from ``L2_GRID`` with the lowest k-fold cross-validated MAE."""
    idx = np.random.default_rng(seed).permutation(len(targets))
    parts = np.array_split(idx, folds)
    best, best_mae = L2_GRID[0], float("inf")
    for l2 in L2_GRID:
        errs = []
        for k in range(folds):
            test = parts[k]
            train = np.concatenate([parts[j] for j in range(folds) if j != k])
            w = fit_ridge(features[train], targets[train], l2)
            errs.append(np.abs(np.clip(features[test] @ w, 1, targets.max()) - targets[test]))
        mae = float(np.mean(np.concatenate(errs)))
        if mae < best_mae:
            best, best_mae = l2, mae
    return best


def train(data: dict[str, Any], num_held_out: int = NUM_HELD_OUT) -> tuple[LinearLengthPredictor, dict[str, Any]]:
    """Fit on prompts ``num_held_out:``, evaluate on ``:num_held_out``, against constant baselines."""
    prompts, lengths = data["prompts"], np.asarray(data["lengths"], dtype=float)
    if len(prompts) != len(lengths) or len(prompts) <= num_held_out + 5:
        raise ValueError(f"need more than {num_held_out + 5} prompts with lengths, got {len(prompts)}")
    x = np.stack([prompt_features(p) for p in prompts])
    x_train, y_train = x[num_held_out:], lengths[num_held_out:]
    y_test = lengths[:num_held_out]
    l2 = choose_l2(x_train, y_train)
    max_len = int(data["max_tokens"])
    predictor = LinearLengthPredictor(fit_ridge(x_train, y_train, l2), max_len)
    pred = [predictor.predict_tokens(p) for p in prompts[:num_held_out]]
    report = {
        "num_train": int(len(y_train)), "num_held_out": int(len(y_test)), "l2": l2,
        "train_mean_length": float(y_train.mean()),
        "held_out_mean_length": float(y_test.mean()),
        "held_out_share_at_cap": float(np.mean(y_test >= max_len)),
        "train_share_at_cap": float(np.mean(y_train >= max_len)),
        "predictor": error_stats(pred, y_test),
        "constant_mean": error_stats(np.full_like(y_test, y_train.mean()), y_test),
        "constant_median": error_stats(np.full_like(y_test, np.median(y_train)), y_test),
    }
    predictor.meta = {"trained_on": "poisson prompts, natural lengths (greedy, EOS honoured, cap 384)",
                      "report": report}
    return predictor, report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"trained on {report['num_train']} prompts (mean length {report['train_mean_length']:.1f}, "
             f"{report['train_share_at_cap']:.0%} at the cap), l2={report['l2']}; "
             f"held out: the workload's {report['num_held_out']} prompts "
             f"(mean length {report['held_out_mean_length']:.1f}, {report['held_out_share_at_cap']:.0%} at the cap)",
             "| predictor | MAE tokens | RMSE tokens | Spearman |", "|---|---|---|---|"]
    for name in ("predictor", "constant_mean", "constant_median"):
        s = report[name]
        lines.append(f"| {name.replace('_', ' ')} | {s['mae']:.1f} | {s['rmse']:.1f} | {s['spearman']:.3f} |")
    return "\n".join(lines)
