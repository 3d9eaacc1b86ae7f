"""The GPU check's sweeps decide on a GPU from the times they measure: given times here, which config each
applies for the sections after, and how the attention sweep times a step's launches."""

from __future__ import annotations

import pytest


def test_the_linear_sweeps_pdl_ab_applies_the_fastest_only_past_its_gain(monkeypatch):
    """`linear_sweep._pdl` on a GPU (times given here): the fastest of the applied config and the fastest plain
    one, each with and without programmatic dependent launch, replaces the applied config when it beats it by
    `PDL_GAIN`; a kernel whose output differs with it fails the A/B and changes nothing."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from kernels.triton_linear import LinearConfig
    from loadtest.gpu_check import linear_sweep

    first, plain = LinearConfig(), LinearConfig(block_m=16, plain_matmuls=True)
    plan = SimpleNamespace(batch=4, dry_run=False)
    monkeypatch.setattr(linear_sweep, "_inputs", lambda *a, **k: {})

    def ab(times, outputs=None):
        seconds = iter(times)
        outs = iter(outputs or [torch.zeros(2)] * len(times))
        monkeypatch.setattr(linear_sweep, "time_captured", lambda fn, device, repeats: (next(seconds), [next(outs)]))
        return linear_sweep._pdl(plan, None, None, [first, plain], (), 2, torch.device("cpu"), 1)

    # the times: the first config without and with, the plain one without and with
    got = ab([100e-6, 90e-6, 80e-6, 70e-6])
    assert got["ok"] and got["applied"] and got["choice"] == {**dataclasses.asdict(plain), "pdl": True}
    got = ab([100e-6, 90e-6, 120e-6, 110e-6])
    assert got["applied"] and got["choice"] == {**dataclasses.asdict(first), "pdl": True}
    got = ab([100e-6, 98e-6, 120e-6, 110e-6])  # within PDL_GAIN: the first, as it was
    assert not got["applied"] and got["choice"] == dataclasses.asdict(first)
    got = ab([100e-6, 50e-6, 120e-6, 110e-6], [torch.zeros(2), torch.ones(2), torch.zeros(2), torch.zeros(2)])
    assert not got["ok"] and not got["applied"] and got["configs"][0]["max_abs_diff"] == 1.0


def test_the_linear_sweeps_small_kernels_pdl_ab_applies_the_other_way_only_past_its_gain(monkeypatch):
    """`linear_sweep._small_pdl` on a GPU (times given here): the separate kernels' layers with their small
    kernels launched without programmatic dependent launch, then with; the other way than the default is set
    for the sections after when it wins by `PDL_GAIN` and the separate kernels are what they run; outputs that
    differ change nothing. The fused kernels' config is None while it times, and put back."""
    from types import SimpleNamespace

    import torch

    from kernels import triton_linear
    from kernels.triton_linear import LinearConfig
    from loadtest.gpu_check import linear_sweep

    assert triton_linear.SMALL_OPS_PDL is False
    plan = SimpleNamespace(batch=4, dry_run=False)
    monkeypatch.setattr(linear_sweep, "_inputs", lambda *a, **k: {})
    monkeypatch.setattr(linear_sweep, "_layers", lambda attn, ops, a: [])
    seen: list = []

    def ab(times, outputs=None, apply=True, default=False, fused=None):
        monkeypatch.setattr(triton_linear, "SMALL_OPS_PDL", default)
        monkeypatch.setattr(triton_linear, "NORM_LINEAR_CONFIG", fused)
        seconds, outs = iter(times), iter(outputs or [torch.zeros(2)] * len(times))
        seen.clear()

        def timed(fn, device, repeats):
            seen.append((triton_linear.SMALL_OPS_PDL, triton_linear.NORM_LINEAR_CONFIG))
            return next(seconds), [next(outs)]

        monkeypatch.setattr(linear_sweep, "time_captured", timed)
        got = linear_sweep._small_pdl(plan, None, None, (), 2, torch.device("cpu"), 1, apply)
        assert triton_linear.NORM_LINEAR_CONFIG is fused
        return got

    got = ab([100e-6, 99e-6])  # within the gain: as it was
    assert seen == [(False, None), (True, None)] and got["ok"] and not got["applied"]
    assert triton_linear.SMALL_OPS_PDL is False and got["us"] == 100 and got["pdl_us"] == 99
    got = ab([100e-6, 90e-6])
    assert got["applied"] and got["pdl"] is True and triton_linear.SMALL_OPS_PDL is True
    got = ab([90e-6, 100e-6], default=True)  # the other direction
    assert got["applied"] and got["pdl"] is False and triton_linear.SMALL_OPS_PDL is False
    got = ab([100e-6, 90e-6], apply=False, fused=LinearConfig())  # the fused kernels applied: measured only
    assert seen == [(False, None), (True, None)] and not got["applied"] and triton_linear.SMALL_OPS_PDL is False
    got = ab([100e-6, 50e-6], [torch.zeros(2), torch.ones(2)])  # outputs differ
    assert not got["ok"] and not got["applied"] and triton_linear.SMALL_OPS_PDL is False


def test_the_attention_sweeps_ab_keeps_the_default_unless_the_other_way_wins_by_its_gain(monkeypatch):
    """`attention_sweep._pdl` and `_one_sequence` on a GPU (times given here): the decode default (programmatic
    dependent launch, automatic splits) stays unless the other way is faster by the gain; then that way is set
    for the sections after, in either direction; outputs that differ change nothing."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from kernels import triton_attention as ta
    from loadtest.gpu_check import attention_sweep

    assert ta.DECODE_CONFIG.pdl and ta.DECODE_CONFIG.num_splits == 0
    default = ta.DECODE_CONFIG
    plan = SimpleNamespace(batch=4, dry_run=False)
    monkeypatch.setattr(attention_sweep, "_inputs",
                        lambda *a, **k: {"context_tokens": 1, "k_cache": torch.zeros(1, 1, 3)})
    seen: list = []

    def ab(fn, times, outputs=None, config=default):
        monkeypatch.setattr(ta, "DECODE_CONFIG", config)
        seconds, outs = iter(times), iter(outputs or [[torch.zeros(2)]] * len(times))

        def per_launch(plan, device, launch, config, x, repeats):
            seen.append(config)
            return next(seconds), next(outs)

        monkeypatch.setattr(attention_sweep, "_per_launch", per_launch)
        seen.clear()
        if fn == "pdl":
            return attention_sweep._pdl(plan, torch.device("cpu"), None, {}, 1)
        return attention_sweep._one_sequence(plan, torch.device("cpu"), None, config, 1)

    # programmatic dependent launch: without, then with
    got = ab("pdl", [100e-6, 99e-6])  # within the gain: as it was
    assert [c.pdl for c in seen] == [False, True] and not got["applied"] and ta.DECODE_CONFIG == default
    got = ab("pdl", [100e-6, 110e-6])
    assert got["applied"] and not got["pdl"] and ta.DECODE_CONFIG == dataclasses.replace(default, pdl=False)
    got = ab("pdl", [110e-6, 100e-6], config=dataclasses.replace(default, pdl=False))
    assert got["applied"] and got["pdl"] and ta.DECODE_CONFIG == default
    got = ab("pdl", [100e-6, 200e-6], [[torch.zeros(2)], [torch.ones(2)]])  # outputs differ
    assert not got["ok"] and not got["applied"] and ta.DECODE_CONFIG == default
    # one sequence: unsplit, then with automatic splits
    got = ab("one", [10e-6, 5e-6])
    assert [c.num_splits for c in seen] == [1, 0] and not got["applied"] and got["auto_splits"]
    got = ab("one", [5e-6, 10e-6])
    assert got["applied"] and not got["auto_splits"] and ta.DECODE_CONFIG.num_splits == 1
    got = ab("one", [10e-6, 5e-6], config=dataclasses.replace(default, num_splits=1))
    assert got["applied"] and got["auto_splits"] and ta.DECODE_CONFIG == default
    got = ab("one", [], config=dataclasses.replace(default, num_splits=2))
    assert not seen and "skipped" in got and ta.DECODE_CONFIG.num_splits == 2


def test_the_attention_sweep_times_a_steps_launches_each_over_its_own_layer(monkeypatch):
    """The attention sweep times each config as a decode step runs it (launched one by one from Python, the
    host would set the pace and hide a faster kernel): every timed call is a step of one launch per layer, each
    over a cache of its own, handed to `time_captured` (one CUDA graph on a GPU), and the time it reports is per
    launch. Outputs are compared layer by layer."""
    import dataclasses

    from kernels import triton_attention as ta
    from loadtest.gpu_check import attention_sweep
    from loadtest.gpu_check.plan import Plan

    plan = dataclasses.replace(Plan.dry(), sweep_layers=3)
    caches: list[int] = []
    real = ta.paged_attention

    def recording(query, k_cache, *args, **kwargs):
        caches.append(k_cache.data_ptr())
        return real(query, k_cache, *args, **kwargs)

    steps: list[tuple[int, int]] = []

    def timed(step, device, repeats):
        caches.clear()
        outs = step()
        steps.append((len(caches), len(set(caches))))
        return 6e-3 * len(outs), [o.clone() for o in outs]

    monkeypatch.setattr(ta, "paged_attention", recording)
    monkeypatch.setattr(attention_sweep, "time_captured", timed)
    result = attention_sweep.sweep(plan, repeats=1)
    # each config, then the single stream plain and split, then the config without and with PDL
    assert len(steps) == len(result["configs"]) + 4 and set(steps) == {(3, 3)}
    assert result["passed"] and result["layers"] == 3
    assert all(r["us"] == pytest.approx(6e3) for r in result["configs"])
    assert result["pdl"]["us"] == pytest.approx(6e3) and result["one_sequence"]["auto_splits_us"] == pytest.approx(6e3)
