"""The trained output-length predictor: features, fitting, file format, and its use by the `predicted`
scheduling policy in the engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadtest.predictor import error_stats, train
from workers.config import EngineConfig
from workers.length_predictor import LinearLengthPredictor, fit_ridge, num_features, prompt_features
from workers.request import Request
from workers.request_queue import PredictedLengthQueue
from workers.sampling_params import SamplingParams


def request(rid: str, prompt: list[int], max_tokens: int = 100, arrival: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, arrival_time=arrival)


def test_features_are_length_and_normalised_buckets() -> None:
    x = prompt_features([1, 2, 3, 3])
    assert x.shape == (num_features(),) and x[0] == 1.0 and x[1] == pytest.approx(4 / 128)
    assert x[2 : 2 + 64].sum() == pytest.approx(1.0) and x[2 + 3] == pytest.approx(0.5)
    assert x[2 + 64 :].sum() == pytest.approx(1.0)
    assert prompt_features([])[2:].sum() == 0


def test_ridge_recovers_a_linear_rule() -> None:
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(200), rng.random((200, 3))])
    y = x @ np.array([5.0, 1.0, -2.0, 3.0])
    assert fit_ridge(x, y, 0.0) == pytest.approx([5.0, 1.0, -2.0, 3.0], abs=1e-6)
    shrunk = fit_ridge(x, y, 1e6)
    assert np.abs(shrunk[1:]).max() < 0.01  # the bias is never penalised
    with pytest.raises(ValueError):
        fit_ridge(x, y[:10], 1.0)


def test_train_learns_length_from_prompts_and_beats_a_constant() -> None:
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 1000, size=int(n))) for n in rng.integers(1, 129, size=300)]
    lengths = [min(384, 3 * len(p) + int(rng.integers(0, 5))) for p in prompts]
    predictor, rep = train({"prompts": prompts, "lengths": lengths, "max_tokens": 384}, num_held_out=100)
    assert rep["num_train"] == 200 and rep["num_held_out"] == 100
    assert rep["predictor"]["mae"] < 0.3 * rep["constant_mean"]["mae"]
    assert rep["predictor"]["spearman"] > 0.9 and rep["constant_mean"]["spearman"] == 0.0
    assert predictor.predict_tokens(prompts[0]) == pytest.approx(lengths[0], abs=20)
    with pytest.raises(ValueError, match="need more than"):
        train({"prompts": prompts[:50], "lengths": lengths[:50], "max_tokens": 384})


def test_error_stats_by_hand() -> None:
    s = error_stats([1.0, 2.0, 3.0, 10.0], [2.0, 2.0, 5.0, 6.0])
    assert s["mae"] == pytest.approx((1 + 0 + 2 + 4) / 4)
    assert s["rmse"] == pytest.approx(np.sqrt((1 + 0 + 4 + 16) / 4))
    assert s["spearman"] == pytest.approx(np.corrcoef([0, 1, 2, 3], [0.5, 0.5, 2, 3])[0, 1])


def test_save_load_round_trip_and_bad_files(tmp_path: Path) -> None:
    w = np.arange(num_features(), dtype=float) / 10
    path = LinearLengthPredictor(w, 384, {"note": "x"}).save(tmp_path / "p.json")
    loaded = LinearLengthPredictor.load(path)
    assert loaded.weights == pytest.approx(w) and loaded.max_len == 384 and loaded.meta == {"note": "x"}
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "other.json").write_text(json.dumps({"weights": []}))
    for name, needle in (("bad.json", "not valid JSON"), ("other.json", "not a kvrelay length predictor"),
                         ("missing.json", "not found")):
        with pytest.raises(ValueError, match=needle):
            LinearLengthPredictor.load(tmp_path / name)
    with pytest.raises(ValueError, match="weights"):
        LinearLengthPredictor([1.0, 2.0], 10)


def prompt_length_predictor() -> LinearLengthPredictor:
    """Predicts 2 tokens per prompt token: ``w = [0, 256, 0...]`` on length/128."""
    w = np.zeros(num_features())
    w[1] = 256.0
    return LinearLengthPredictor(w, 384)


def test_predicted_queue_orders_by_prediction_capped_by_max_tokens() -> None:
    queue = PredictedLengthQueue(prompt_length_predictor(), aging_rate=0.0)
    long_prompt = request("long", list(range(100)))            # predicts 200, max_tokens 100 -> 100
    short_prompt = request("short", list(range(10)))           # predicts 20
    capped = request("capped", list(range(120)), max_tokens=5)  # predicts 240, capped at 5
    for r in (long_prompt, short_prompt, capped):
        queue.add(r)
    assert [r.request_id for r in queue] == ["capped", "short", "long"]
    assert short_prompt.predicted_cost == pytest.approx(20.0)
    assert long_prompt.predicted_cost == pytest.approx(100.0)


def test_engine_config_checks_the_predictor_option(tmp_path: Path, tiny_model_dir: str) -> None:
    with pytest.raises(ValueError, match="only used by scheduling_policy 'predicted'"):
        EngineConfig(length_predictor="x.json")
    from serving import LLM

    with pytest.raises(ValueError, match="not found"):
        LLM(model=tiny_model_dir, scheduling_policy="predicted", length_predictor=str(tmp_path / "none.json"),
            kv_cache_memory="32MiB")
    path = prompt_length_predictor().save(tmp_path / "p.json")
    llm = LLM(model=tiny_model_dir, dtype="float32", scheduling_policy="predicted", length_predictor=str(path),
              kv_cache_memory="32MiB")
    queue = llm.engine.scheduler.waiting
    assert isinstance(queue.predictor, LinearLengthPredictor)
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
