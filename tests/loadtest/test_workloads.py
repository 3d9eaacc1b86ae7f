"""Fast tests of the workload generators and the static-batching accounting."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from loadtest import workloads as wl


class CharTokenizer:
    """Tokenizer stub: one id per character, id == character position."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        assert add_special_tokens is False
        return SimpleNamespace(input_ids=list(range(len(text))))


TOK = CharTokenizer()
N_TOKENS = len(wl.load_corpus())


def expected_offset(i: int, length: int) -> int:
    return (i * 997) % (N_TOKENS - length)


@pytest.mark.parametrize("cap", wl.BURST_CAPS)
def test_burst_shape_and_caps(cap: int) -> None:
    reqs = wl.burst_requests(TOK, cap)
    assert len(reqs) == 256
    assert all(1 <= r.output_len <= cap for r in reqs)
    assert all(len(r.prompt_token_ids) == 128 and r.arrival_time == 0.0 for r in reqs)
    assert reqs == wl.burst_requests(TOK, cap)  # deterministic


def test_burst_lengths_match_independent_derivation() -> None:
    rng = np.random.default_rng(0)
    draws = (math.ceil(rng.exponential(64)) for _ in itertools.count())
    expected = list(itertools.islice((x for x in draws if x <= 64), 20))
    assert wl.burst_output_lens(64)[:20] == expected
    assert [r.output_len for r in wl.burst_requests(TOK, 64)[:20]] == expected


def test_burst_offsets_follow_formula() -> None:
    for i, r in enumerate(wl.burst_requests(TOK, 16)):
        o = expected_offset(i, 128)
        assert r.prompt_token_ids == list(range(o, o + 128))


def test_poisson_lengths_and_arrivals() -> None:
    reqs = wl.poisson_requests(TOK, qps=2.0)
    assert len(reqs) == 100
    rng = np.random.default_rng(1)
    for i, r in enumerate(reqs):
        prompt_len = int(rng.integers(1, 129))
        assert len(r.prompt_token_ids) == prompt_len
        assert r.prompt_token_ids[0] == expected_offset(i, prompt_len)
        assert r.output_len == min(math.ceil(rng.exponential(64)), 384)
    gaps = np.random.default_rng(2).exponential(1 / 2.0, size=100)
    np.testing.assert_allclose([r.arrival_time for r in reqs], np.cumsum(gaps))
    assert len(wl.poisson_requests(TOK, qps=2.0, num_requests=7)) == 7


def test_long_prompt_mix() -> None:
    reqs = wl.long_prompt_requests(TOK)
    assert len(reqs) == 200
    rng = np.random.default_rng(4)
    expected_long = [rng.random() < 0.1 for _ in range(200)]
    shapes = [(len(r.prompt_token_ids), r.output_len) for r in reqs]
    assert shapes == [(2048, 16) if long_ else (64, 64) for long_ in expected_long]
    assert 5 <= sum(expected_long) <= 40
    gaps = np.random.default_rng(3).exponential(1 / 4.0, size=200)
    np.testing.assert_allclose([r.arrival_time for r in reqs], np.cumsum(gaps))


def test_prompt_slice_rejects_short_corpus() -> None:
    with pytest.raises(ValueError):
        wl.prompt_slice(list(range(10)), 0, 10)


def _tiny_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _tiny_requests() -> list[wl.BenchRequest]:
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]
    return [wl.BenchRequest(p, n) for p, n in zip(prompts, [1, 3, 5, 2, 4, 6])]


def test_hf_static_accounting() -> None:
    from loadtest.baselines import hf_naive, hf_static

    model, reqs = _tiny_llama(), _tiny_requests()
    res = hf_static(model, reqs, batch_size=4)
    assert res.system == "hf-static-4"
    assert res.useful_tokens == sum(r.output_len for r in reqs) == 21
    assert res.generated_tokens == 4 * 5 + 2 * 6  # each batch runs to its longest member
    assert [len(ids) for ids in res.token_ids] == [r.output_len for r in reqs]
    assert res.padding_waste == pytest.approx(1 - 21 / 32)
    naive = hf_naive(model, reqs)
    assert naive.useful_tokens == naive.generated_tokens == 21


def test_hf_static_left_padding_matches_naive() -> None:
    from loadtest.baselines import hf_naive, hf_static

    model, reqs = _tiny_llama(), _tiny_requests()
    assert hf_static(model, reqs, batch_size=4).token_ids == hf_naive(model, reqs).token_ids


class _FakeLLM:
    """Stands in for ``serving.LLM``: returns ``short`` fewer tokens than asked."""

    def __init__(self, short: int = 0) -> None:
        self.short = short

    def generate(self, prompts, params, use_tqdm=False):
        assert len(prompts) == len(params) and use_tqdm is False
        assert all(p.temperature == 0.0 and p.ignore_eos for p in params)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * max(p.max_tokens - self.short, 0))])
                for p in params]


@pytest.fixture
def fake_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "serving", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))


def test_run_engine_counts_and_verification(fake_serving: None) -> None:
    from loadtest.offline import run_engine

    reqs = _tiny_requests()
    res = run_engine(_FakeLLM(), reqs)
    assert res.useful_tokens == res.generated_tokens == 21 and res.num_requests == 6
    with pytest.raises(RuntimeError, match="expected"):
        run_engine(_FakeLLM(short=1), reqs)
