"""Options of the Serve application: engine options (`EngineConfig`) plus serving, replica and
autoscaling options, from `serve run` key=value strings, a YAML config or the `kvrelay serve` CLI."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from workers.config import EngineConfig


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: str | None = Field(None, description="Model name clients send; default: the model folder's name.")
    api_key: str | None = Field(None, description="Require 'Authorization: Bearer <key>' on /v1 routes (or set KVRELAY_API_KEY).")
    num_replicas: int | None = Field(None, ge=1, description="Fixed number of engine replicas (turns autoscaling off).")
    min_replicas: int = Field(1, ge=0, description="Autoscaling: fewest engine replicas.")
    max_replicas: int = Field(1, ge=1, description="Autoscaling: most engine replicas (autoscaling is on when > min).")
    initial_replicas: int | None = Field(None, ge=0, description="Autoscaling: replicas at start (default: min).")
    target_ongoing_requests: float = Field(32.0, gt=0, description="Autoscaling: in-flight requests per replica to aim for.")
    upscale_delay_s: float = Field(30.0, ge=0, description="Autoscaling: how long load must stay high before adding a replica.")
    downscale_delay_s: float = Field(300.0, ge=0, description="Autoscaling: how long load must stay low before removing one.")
    look_back_period_s: float = Field(10.0, gt=0, description="Autoscaling: window over which load is averaged.")
    metrics_interval_s: float = Field(1.0, gt=0, description="Autoscaling: how often replicas report their load.")
    max_waiting_requests: int | None = Field(1024, ge=0, description="Per replica: requests waiting beyond this get HTTP 429.")
    max_ongoing_requests: int = Field(1024, ge=1, description="Per replica: Serve's cap on in-flight requests.")
    max_request_body_bytes: int = Field(8 << 20, ge=1, description="Larger request bodies get HTTP 413.")
    routing_stats_period_s: float = Field(1.0, gt=0, description="How often replicas report load to the router.")

    @model_validator(mode="after")
    def _check_bounds(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.num_replicas is None and self.max_replicas > self.min_replicas

    def worker_deployment_options(self) -> dict[str, Any]:
        from ray.serve.config import RequestRouterConfig

        from router.request_router import KVRelayRequestRouter

        opts: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "request_router_config": RequestRouterConfig(
                request_router_class=KVRelayRequestRouter,
                request_routing_stats_period_s=self.routing_stats_period_s,
                request_routing_stats_timeout_s=max(5.0, 5 * self.routing_stats_period_s)),
        }
        if self.autoscaling:
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.initial_replicas, "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s, "metrics_interval_s": self.metrics_interval_s,
            }
        else:
            opts["num_replicas"] = self.num_replicas or self.min_replicas or 1
        return opts


_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def parse_app_args(args: dict[str, Any]) -> AppConfig:
    """Flat key=value options (strings from `serve run` are converted) into an `AppConfig`.
    Raises ValueError naming an unknown option or a bad value."""
    args = {k.replace("-", "_"): v for k, v in args.items()}
    unknown = sorted(set(args) - _ENGINE_FIELDS - set(AppConfig.model_fields) - {"engine"})
    if unknown:
        raise ValueError(f"unknown option(s): {', '.join(unknown)}")
    engine_args = {k: _none(v) for k, v in args.items() if k in _ENGINE_FIELDS}
    try:
        engine = TypeAdapter(EngineConfig).validate_python(engine_args) if engine_args else args.get("engine", EngineConfig())
        serving_args = {k: _none(v) for k, v in args.items() if k in AppConfig.model_fields and k != "engine"}
        return AppConfig(engine=engine, **serving_args)
    except Exception as e:
        raise ValueError(f"invalid application options: {e}") from None


def _none(value: Any) -> Any:
    return None if isinstance(value, str) and value.lower() in ("none", "null", "") else value
