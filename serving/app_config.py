"""Options of the Serve application: engine options (`EngineConfig`) plus serving, replica and
autoscaling options, from `serve run` key=value strings, a YAML config or the `kvrelay serve` CLI."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from serving.chat import load_chat_template
from workers.config import EngineConfig
from workers.replica_drain import DRAIN_POLL_S


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: list[str] | None = Field(None, min_length=1, description="Model name(s) clients send; "
                                                "responses report the first; default: the model folder's name.")
    chat_template: str | None = Field(None, description="Chat template in place of the tokenizer's: a Jinja file's "
                                      "path, or the template itself.")
    trust_request_chat_template: bool = Field(False, description="Accept a chat_template in requests (else HTTP 400).")
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="Variables (JSON) for "
                                                         "every chat template render; a request's "
                                                         "chat_template_kwargs override them.")
    api_key: str | None = Field(None, description="Require 'Authorization: Bearer <key>' on /v1 routes, /tokenize and "
                                   "/detokenize (or set KVRELAY_API_KEY).")
    enable_auto_tool_choice: bool = Field(False, description="Serve tool_choice \"auto\" (the default when a request "
                                          "has tools): the model may call tools, found by --tool-call-parser.")
    tool_call_parser: str | None = Field(None, description="How tool calls are found in the output "
                                                       "for tool_choice auto: hermes (<tool_call>{json}</tool_call>).")
    num_replicas: int | None = Field(None, ge=1, description="Fixed number of engine replicas (turns autoscaling off).")
    min_replicas: int = Field(1, ge=0, description="Autoscaling: fewest engine replicas.")
    max_replicas: int = Field(1, ge=1, description="Autoscaling: most engine replicas (autoscaling is on when > min).")
    initial_replicas: int | None = Field(None, ge=0, description="Autoscaling: replicas at start (default: min).")
    target_ongoing_requests: float = Field(32.0, gt=0, description="Autoscaling: in-flight requests per replica to aim for.")
    upscale_delay_s: float = Field(30.0, ge=0, description="Autoscaling: how long load must stay high before adding a replica.")
    downscale_delay_s: float = Field(300.0, ge=0, description="Autoscaling: how long load must stay low before removing one.")
    look_back_period_s: float = Field(10.0, gt=0, description="Autoscaling: window over which load is averaged.")
    metrics_interval_s: float = Field(1.0, gt=0, description="Autoscaling: how often replicas report their load.")
    num_gpus: float | None = Field(None, ge=0, description="GPUs each engine replica (each rank, with tensor "
                                   "parallelism) asks Ray for (fractions let a prefill and a decode replica share one "
                                   "GPU); default: 1 when the engine's device is cuda, else 0.")
    max_waiting_requests: int | None = Field(1024, ge=0, description="Per replica: most sequences that may wait beyond "
                                             "those that can start now (free slots with KV room); a request that would "
                                             "exceed it gets HTTP 429 with Retry-After. 0 admits only what can start "
                                             "at once (the rule: docs/reliability.md).")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Per replica: Serve's cap on open calls (a request holds one until it ends); calls "
                                "beyond it wait, unbounded, in Serve's router; default: max_num_seqs + "
                                "max_waiting_requests (1024 if unlimited) + 64, so a busy replica answers 429 first.")
    max_request_body_bytes: int = Field(8 << 20, ge=1, description="Larger request bodies get HTTP 413.")
    max_prompts_per_request: int = Field(1024, ge=1, description="Most prompts in one /v1/completions `prompt` "
                                         "list; more get HTTP 400 naming prompt.")
    max_sequences_per_request: int = Field(1024, ge=1, description="Most sequences one request starts (prompts x n); "
                                           "more get HTTP 400 naming n.")
    engine_in_ingress: bool | None = Field(None, description="Run the engine in the HTTP ingress's replica, one "
                                           "process, so a step's tokens reach the client without a message between "
                                           "processes; default: on when the app has one engine replica (fixed, not "
                                           "disaggregated, no tensor parallelism), which is when it can.")
    routing_stats_period_s: float = Field(1.0, gt=0, description="How often replicas report load to the router.")
    disaggregate: bool = Field(False, description="Run separate prefill and decode pools that hand off KV blocks.")
    prefill_replicas: int = Field(1, ge=1, description="Disaggregated: prefill replicas (autoscaling lower bound).")
    decode_replicas: int = Field(1, ge=1, description="Disaggregated: decode replicas (autoscaling lower bound).")
    prefill_max_replicas: int | None = Field(None, ge=1, description="Disaggregated: autoscale prefill up to this.")
    decode_max_replicas: int | None = Field(None, ge=1, description="Disaggregated: autoscale decode up to this.")
    prefill_engine: dict[str, Any] = Field(default_factory=dict, description="Disaggregated: engine options of the "
                                           "prefill pool on top of the shared ones (JSON), e.g. a larger token budget.")
    decode_engine: dict[str, Any] = Field(default_factory=dict, description="Disaggregated: engine options of the "
                                          "decode pool on top of the shared ones (JSON), e.g. a larger max_num_seqs.")
    kv_transport: str = Field("auto", description="Disaggregated: auto, object_store, gloo, nccl, "
                              "cuda_ipc (one GPU) or cuda_ipc+nccl.")
    kv_lease_s: float = Field(30.0, gt=0, description="Disaggregated: a prefill replica frees unclaimed KV after this.")
    kv_fetch_delay_s: float = Field(0.0, ge=0, description="Fault injection for tests: decode replicas wait this "
                                    "long before fetching KV.")
    replica_wait_timeout_s: float = Field(10.0, gt=0, description="A request that no engine replica accepts within "
                                          "this long (none is ready, or all are full) gets HTTP 503.")
    drain_timeout_s: float = Field(30.0, ge=0, description="Scale-down, redeploy or shutdown: requests in flight on "
                                   "a stopping replica may run this long, then end with an error.")
    health_check_period_s: float = Field(2.0, gt=0, description="How often Serve checks each engine replica; three "
                                         "failed checks in a row and it is replaced.")
    health_check_timeout_s: float = Field(10.0, gt=0, description="An engine replica's health check that takes "
                                          "longer than this fails.")
    max_failed_steps: int = Field(5, ge=1, description="An engine replica whose last N engine steps all failed "
                                  "reports unhealthy (and is replaced).")

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        """Read a template file once, here, so that the ingress replicas get its text."""
        return load_chat_template(value)

    @model_validator(mode="after")
    def _check_tools(self):
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes)")
        return self

    @model_validator(mode="after")
    def _check_bounds(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self

    @model_validator(mode="after")
    def _check_engine_in_ingress(self):
        blocker = self._engine_in_ingress_blocker() if self.engine_in_ingress else None
        if blocker:
            raise ValueError(f"engine_in_ingress needs one engine replica, but {blocker}")
        return self

    def _engine_in_ingress_blocker(self) -> str | None:
        """Why the engine cannot run in the ingress's replica (None: it can)."""
        if self.disaggregate:
            return "the app is disaggregated (a prefill and a decode pool)"
        if self.autoscaling:
            return f"the app autoscales ({self.min_replicas} to {self.max_replicas} replicas)"
        if self.fixed_replicas != 1:
            return f"the app has {self.fixed_replicas} replicas"
        if self.engine.tensor_parallel_size > 1:
            return f"the engine is split over {self.engine.tensor_parallel_size} ranks (tensor_parallel_size)"
        return None

    @property
    def engine_runs_in_ingress(self) -> bool:
        """`engine_in_ingress` resolved: as set, or, by default, whenever the app allows it."""
        if self.engine_in_ingress is not None:
            return self.engine_in_ingress
        return self._engine_in_ingress_blocker() is None

    @model_validator(mode="after")
    def _check_pools(self):
        if not self.disaggregate:
            return self
        from workers.model_loader import dtype_name, resolve_dtype
        from workers.sizing import dtype_device

        def value(engine: EngineConfig, name: str):
            """`dtype` as each pool's engine will read it: `auto` by its kind of device (a GPU pool's by the CUDA
            rule even where this process has no GPU; a CPU pool's by this CPU, like the pools' in a cluster)."""
            if name != "dtype" or engine.dtype != "auto":
                return getattr(engine, name)
            return dtype_name(resolve_dtype("auto", dtype_device(engine)))

        prefill, decode = self.pool_engine("prefill"), self.pool_engine("decode")
        diffs = [f"{name} {getattr(prefill, name)!r} vs {getattr(decode, name)!r}"
                 for name in ("model", "dtype", "block_size") if value(prefill, name) != value(decode, name)]
        if diffs:
            raise ValueError("the prefill and decode pools must agree to hand off KV blocks; they differ in "
                             + ", ".join(diffs))
        return self

    def pool_engine(self, pool: str) -> EngineConfig:
        """The engine options of one pool of a disaggregated app: the shared ones plus its overrides."""
        overrides = self.prefill_engine if pool == "prefill" else self.decode_engine
        unknown = sorted(set(overrides) - _ENGINE_FIELDS)
        if unknown:
            raise ValueError(f"unknown {pool}_engine option(s): {', '.join(unknown)}")
        return TypeAdapter(EngineConfig).validate_python({**dataclasses.asdict(self.engine), **overrides})

    def pool_deployment_options(self, pool: str) -> dict[str, Any]:
        low = self.prefill_replicas if pool == "prefill" else self.decode_replicas
        high = (self.prefill_max_replicas if pool == "prefill" else self.decode_max_replicas) or low
        scaled = self.model_copy(update={"num_replicas": None if high > low else low, "min_replicas": low,
                                         "max_replicas": max(low, high), "initial_replicas": None})
        return scaled.worker_deployment_options(self.pool_engine(pool))

    def replica_max_ongoing_requests(self, engine: EngineConfig) -> int:
        """Serve's cap on open calls per engine replica: room for every sequence the replica admits (each
        request is one open `generate` call), plus headroom for subscriber streams and metric scrapes."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        waiting = 1024 if self.max_waiting_requests is None else self.max_waiting_requests
        return engine.max_num_seqs + waiting + _CALL_HEADROOM

    @property
    def fixed_replicas(self) -> int:
        """The engine replica count when the app does not autoscale."""
        return self.num_replicas or self.min_replicas or 1

    @property
    def autoscaling(self) -> bool:
        return self.num_replicas is None and self.max_replicas > self.min_replicas

    def worker_deployment_options(self, engine: EngineConfig | None = None) -> dict[str, Any]:
        from ray.serve.config import RequestRouterConfig

        from router.request_router import KVRelayRequestRouter

        engine = engine or self.engine
        threads = str(engine.num_threads)
        gpus = self.num_gpus if self.num_gpus is not None else (1 if engine.device.startswith("cuda") else 0)
        tp = engine.tensor_parallel_size
        opts: dict[str, Any] = {
            # Ray sets OMP_NUM_THREADS=1 in actors (from num_cpus=0); the engine's OpenMP code (our compiled
            # kernel, oneDNN) reads it once at start, so give it the engine's thread count instead.
            "ray_actor_options": {"num_cpus": 0, "num_gpus": 0 if tp > 1 else gpus,
                                  "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, **SERVE_REPLICA_ENV}}},
            "max_ongoing_requests": self.replica_max_ongoing_requests(engine),
            "request_router_config": RequestRouterConfig(
                request_router_class=KVRelayRequestRouter,
                request_routing_stats_period_s=self.routing_stats_period_s,
                request_routing_stats_timeout_s=max(5.0, 5 * self.routing_stats_period_s)),
        }
        if tp > 1:  # the replica (scheduler only) shares bundle 0 with rank 0; rank i takes bundle i
            bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
            opts["placement_group_bundles"] = [dict(bundle) for _ in range(tp)]
            opts["placement_group_strategy"] = "PACK"
        opts.update(self._lifecycle_options())
        if self.autoscaling:
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.initial_replicas, "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s, "metrics_interval_s": self.metrics_interval_s,
            }
        else:
            opts["num_replicas"] = self.fixed_replicas
        return opts

    def _lifecycle_options(self) -> dict[str, Any]:
        """Serve's health-check and drain settings of an engine deployment. A stopping replica ends what
        still runs on it at `drain_timeout_s`; Serve force-kills it `DRAIN_MARGIN_S` later, time for the
        ingress's fallback cut (it counts from when its router drops the replica, which can lag Serve's
        stop under load)."""
        return {"health_check_period_s": self.health_check_period_s,
                "health_check_timeout_s": self.health_check_timeout_s,
                "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
                "graceful_shutdown_timeout_s": self.drain_timeout_s + DRAIN_MARGIN_S}

    def ingress_deployment_options(self) -> dict[str, Any]:
        """The ingress outlives the engine replicas' drain, so it can still send the error events that end
        the streams cut at `drain_timeout_s`. With the engine in the ingress's replica, the ingress takes the
        engine replica's options (threads, GPUs, health checks, drain; one replica) less its request router:
        the proxy routes HTTP requests to it, one call per request, as to an engine replica."""
        if self.engine_runs_in_ingress:
            opts = self.worker_deployment_options()
            del opts["request_router_config"]
            return opts
        return {"ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": dict(SERVE_REPLICA_ENV)}},
                "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
                "graceful_shutdown_timeout_s": self.drain_timeout_s + 2 * DRAIN_MARGIN_S}


# Serve settings of kvrelay's replicas, read by Serve as the replica's process starts. Serve runs a replica's
# code (the ingress's handlers, the engine client, the engine's publishing) on an event loop of its own by
# default, beside the loop that serves HTTP (direct ingress) and talks to the controller, so each chunk of a
# stream crosses from one thread to the other. At GPU rates a replica streams thousands of chunks a second:
# on one loop a replica streamed ~1.25x the tokens (docs/benchmarks.md, "Streams at a GPU's rate"). Our
# handlers never block their loop (the engine steps in a thread of its own; Serve still runs sync methods in
# its thread pool).
SERVE_REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
TOOL_CALL_PARSERS = ("hermes",)
# Serve force-kills a stopping engine replica this long after drain_timeout_s. The replica ends its own
# requests at drain_timeout_s; the margin is for the ingress's fallback, which counts from when Serve's long
# poll tells it of the stop (over 10 s late on a loaded 2-core host).
DRAIN_MARGIN_S = 30.0
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_JSON_OPTIONS = ("prefill_engine", "decode_engine", "default_chat_template_kwargs")
_CALL_HEADROOM = 64  # open calls beyond generate: one subscribe stream per ingress replica, scrapes, KV releases


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
        serving_args = {k: _json(_none(v)) if k in _JSON_OPTIONS else _none(v)
                        for k, v in args.items() if k in AppConfig.model_fields and k != "engine"}
        return AppConfig(engine=engine, **serving_args)
    except Exception as e:
        raise ValueError(f"invalid application options: {e}") from None


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else (value or {})


def _none(value: Any) -> Any:
    return None if isinstance(value, str) and value.lower() in ("none", "null", "") else value
