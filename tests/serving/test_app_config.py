"""The health-check and drain options reach the deployments that `build_app` binds; tensor parallelism
gives the engine replica a placement group; the engine runs in the ingress's replica when the app can."""

from __future__ import annotations

import argparse

import pytest

from serving.app import build_app
from serving.app_config import AppConfig, parse_app_args
from workers.config import EngineConfig


def _deployments(app) -> tuple:
    ingress = app._bound_deployment
    return ingress, ingress.init_args[0]._bound_deployment  # the engine (decode pool when disaggregated)


def test_lifecycle_options_reach_the_engine_and_ingress_deployments():
    for options in ({"engine_in_ingress": "false"}, {"disaggregate": True}):
        config = parse_app_args({**options, "drain_timeout_s": "12", "health_check_period_s": "1",
                                 "health_check_timeout_s": "4", "max_failed_steps": "3"})
        ingress, engine = _deployments(build_app(config))
        engine_config = engine._deployment_config
        assert (engine_config.health_check_period_s, engine_config.health_check_timeout_s) == (1, 4)
        assert 12 < engine_config.graceful_shutdown_timeout_s < ingress._deployment_config.graceful_shutdown_timeout_s
        assert engine.init_kwargs["max_failed_steps"] == 3
        assert ingress.init_args[1]["replica_wait_timeout_s"] == 10  # the default, read by the ingress
        for dep in (ingress, engine):  # each replica runs its code on Serve's own loop (SERVE_REPLICA_ENV)
            assert dep.ray_actor_options["runtime_env"]["env_vars"]["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
            assert dep.ray_actor_options["num_cpus"] == 0  # what the class's decorator says, kept


def test_the_engine_runs_in_the_ingress_by_default_when_the_app_has_one_engine_replica():
    app = build_app(parse_app_args({"drain_timeout_s": "12", "health_check_period_s": "1", "num_threads": "2"}))
    ingress = app._bound_deployment
    assert ingress.init_args[0] is None  # no engine deployment: the ingress builds the engine
    cfg = ingress._deployment_config
    assert (cfg.num_replicas, cfg.health_check_period_s) == (1, 1) and cfg.graceful_shutdown_timeout_s > 12
    assert ingress.ray_actor_options["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "2"
    assert cfg.max_ongoing_requests == AppConfig().replica_max_ongoing_requests(EngineConfig())
    for options, why in (({"disaggregate": True}, "disaggregated"), ({"max_replicas": 2}, "autoscales"),
                         ({"num_replicas": 2}, "2 replicas"), ({"engine": EngineConfig(tensor_parallel_size=2)}, "ranks")):
        assert not AppConfig(**options).engine_runs_in_ingress  # auto: an engine deployment of its own
        with pytest.raises(ValueError, match=f"engine_in_ingress needs one engine replica, but .*{why}"):
            AppConfig(engine_in_ingress=True, **options)
    assert not AppConfig(engine_in_ingress=False).engine_runs_in_ingress


def test_tensor_parallel_size_gives_the_engine_replica_one_bundle_per_rank():
    from serving.cli import add_app_options, add_engine_options, app_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    add_app_options(parser)
    config = app_config_from_args(parser.parse_args(["--tensor-parallel-size", "3"]))
    opts = config.worker_deployment_options()
    assert config.engine.tensor_parallel_size == 3
    assert opts["placement_group_bundles"] == [{"CPU": 1}] * 3 and opts["placement_group_strategy"] == "PACK"
    assert opts["ray_actor_options"]["num_gpus"] == 0  # the replica only schedules; ranks hold the model
    gpu = AppConfig(engine=EngineConfig(tensor_parallel_size=2, device="cuda")).worker_deployment_options()
    assert gpu["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}] * 2
    assert "placement_group_bundles" not in AppConfig().worker_deployment_options()
    pd = AppConfig(engine=EngineConfig(tensor_parallel_size=2), disaggregate=True,
                   decode_engine={"tensor_parallel_size": 1})  # the KV payload holds all heads: sizes may differ
    assert len(pd.pool_deployment_options("prefill")["placement_group_bundles"]) == 2
    assert "placement_group_bundles" not in pd.pool_deployment_options("decode")


@pytest.mark.parametrize("native", [True, False])
def test_the_pools_must_agree_on_the_dtype_auto_resolves_to(native, monkeypatch):
    """A pool left at `dtype="auto"` agrees with one that names what `auto` gives its kind of device (bfloat16 on
    a CPU whose oneDNN runs it, float32 on others; bfloat16 for a GPU pool); a pool that names another is refused
    before anything is deployed, as a differing block size is."""
    from kernels import cpu_extension

    monkeypatch.setattr(cpu_extension, "onednn_bf16", lambda: native)
    same, other = ("bfloat16", "float32") if native else ("float32", "bfloat16")
    AppConfig(disaggregate=True, prefill_engine={"dtype": same})
    with pytest.raises(ValueError, match=f"must agree .*dtype '{other}' vs 'auto'"):
        AppConfig(disaggregate=True, prefill_engine={"dtype": other})
    AppConfig(disaggregate=True, engine=EngineConfig(device="cuda"), decode_engine={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="block_size 32 vs 16"):
        AppConfig(disaggregate=True, prefill_engine={"block_size": 32})
