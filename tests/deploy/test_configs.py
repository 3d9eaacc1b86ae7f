"""The deploy configs are valid Ray Serve documents whose args build the application."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from serving.app import build_app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def check(doc: dict) -> None:
    schema = ServeDeploySchema.model_validate(doc)
    (app,) = schema.applications
    assert app.import_path == "serving.app:build_app"
    build_app(app.args)


def test_serve_config():
    check(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))


def test_serve_config_disaggregated():
    doc = yaml.safe_load((DEPLOY / "serve_config_disaggregated.yaml").read_text())
    check(doc)
    assert doc["applications"][0]["args"]["disaggregate"] is True


def test_rayservice():
    doc = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    assert doc["kind"] == "RayService"
    check(yaml.safe_load(doc["spec"]["serveConfigV2"]))


def test_rayservice_gpu_asks_ray_and_kubernetes_for_gpus():
    doc = yaml.safe_load((DEPLOY / "rayservice_gpu.yaml").read_text())
    serve_doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
    check(serve_doc)
    from serving.app_config import parse_app_args

    config = parse_app_args(serve_doc["applications"][0]["args"])
    assert config.engine.device == "cuda"
    assert config.worker_deployment_options()["ray_actor_options"]["num_gpus"] == 1
    worker = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    half = parse_app_args({"device": "cuda", "num_gpus": "0.5", "disaggregate": "true"})
    assert half.pool_deployment_options("decode")["ray_actor_options"]["num_gpus"] == 0.5
    assert parse_app_args({}).worker_deployment_options()["ray_actor_options"]["num_gpus"] == 0
