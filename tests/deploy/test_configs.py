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
