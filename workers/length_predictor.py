"""A trained output-length predictor for the `predicted` scheduling policy.

A linear model over cheap prompt features (length, a hashed bag of its tokens, a hashed bag of its
last few tokens), fitted offline by `kvrelay bench train-predictor` on the lengths the model
generates when it is left to stop by itself, and stored as a small JSON file. The engine loads it
with `--length-predictor PATH`; prediction is one dot product at admission time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FORMAT = "kvrelay-linear-length-predictor/1"
BAG_BUCKETS = 64
TAIL_BUCKETS = 32
TAIL_TOKENS = 4
LEN_SCALE = 128.0


def num_features() -> int:
    return 2 + BAG_BUCKETS + TAIL_BUCKETS


def prompt_features(token_ids: Sequence[int]) -> np.ndarray:
    """Feature vector of one prompt: bias, length/128, token-bucket frequencies, last-token buckets."""
    x = np.zeros(num_features(), dtype=np.float64)
    x[0] = 1.0
    n = len(token_ids)
    x[1] = n / LEN_SCALE
    if n:
        ids = np.asarray(token_ids, dtype=np.int64)
        np.add.at(x, 2 + ids % BAG_BUCKETS, 1.0 / n)
        tail = ids[-TAIL_TOKENS:]
        np.add.at(x, 2 + BAG_BUCKETS + tail % TAIL_BUCKETS, 1.0 / len(tail))
    return x


class LinearLengthPredictor:
    """`predict(request)` = clip(w · features(prompt), 1, request.max_tokens)."""

    def __init__(self, weights: Sequence[float], max_len: int, meta: dict[str, Any] | None = None) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (num_features(),):
            raise ValueError(f"length predictor has {w.size} weights, expected {num_features()}")
        if max_len < 1:
            raise ValueError(f"length predictor max_len must be >= 1, got {max_len}")
        self.weights = w
        self.max_len = int(max_len)
        self.meta = dict(meta or {})

    def predict_tokens(self, token_ids: Sequence[int]) -> float:
        return float(np.clip(prompt_features(token_ids) @ self.weights, 1.0, self.max_len))

    def predict(self, request: Any) -> float:
        return min(float(request.max_tokens), self.predict_tokens(request.prompt_token_ids))

    def observe(self, request: Any) -> None:
        """Fixed after training: finished requests don't move it."""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "max_len": self.max_len, "weights": self.weights.tolist(), "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LinearLengthPredictor:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"length predictor file not found: {path}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"length predictor {path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a kvrelay length predictor (expected format {FORMAT!r})")
        return cls(data["weights"], data["max_len"], data.get("meta"))


def fit_ridge(features: np.ndarray, targets: np.ndarray, l2: float) -> np.ndarray:
    """Least squares with an L2 penalty on every weight but the bias."""
    if features.shape[0] != targets.shape[0] or features.shape[0] == 0:
        raise ValueError("fit_ridge needs as many targets as feature rows, and at least one")
    penalty = np.full(features.shape[1], float(l2))
    penalty[0] = 0.0
    gram = features.T @ features + np.diag(penalty)
    return np.linalg.solve(gram + 1e-9 * np.eye(gram.shape[0]), features.T @ targets)
