"""The health-check and drain options reach the deployments that `build_app` binds."""

from __future__ import annotations

from serving.app import build_app
from serving.app_config import parse_app_args


def _deployments(app) -> tuple:
    ingress = app._bound_deployment
    return ingress, ingress.init_args[0]._bound_deployment  # the engine (decode pool when disaggregated)


def test_lifecycle_options_reach_the_engine_and_ingress_deployments():
    for options in ({}, {"disaggregate": True}):
        config = parse_app_args({**options, "drain_timeout_s": "12", "health_check_period_s": "1",
                                 "health_check_timeout_s": "4", "max_failed_steps": "3"})
        ingress, engine = _deployments(build_app(config))
        engine_config = engine._deployment_config
        assert (engine_config.health_check_period_s, engine_config.health_check_timeout_s) == (1, 4)
        assert 12 < engine_config.graceful_shutdown_timeout_s < ingress._deployment_config.graceful_shutdown_timeout_s
        assert engine.init_kwargs["max_failed_steps"] == 3
        assert ingress.init_args[1]["replica_wait_timeout_s"] == 10  # the default, read by the ingress
