"""`kvrelay` command line. Its engine and serving flags are generated from `EngineConfig` and `AppConfig`
(vLLM's spellings): each flag's type, default and help come from its field."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
import types
import typing
from typing import TYPE_CHECKING, Any

from workers.config import EngineConfig

if TYPE_CHECKING:
    from serving.app_config import AppConfig


DEFAULT_PROMPT = "What is continuous batching in LLM serving?"
APP_NAME = "kvrelay"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every option's default, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def flag_options(name: str, annotation: Any) -> dict[str, Any]:
    """argparse keywords for an option of this type: a bool is `--x/--no-x`; int, float or str (alone or
    with None) is that type; a list of str takes one or more values; a union with str (`int | str`) or a
    dict stays a string, which the config parses (a size such as '2GiB', JSON)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = tuple(k for k in (typing.get_args(annotation) if union else (annotation,)) if k is not type(None))
    if kinds == (bool,):
        return {"action": argparse.BooleanOptionalAction}
    if len(kinds) == 1 and kinds[0] in (int, float, str):
        return {"type": kinds[0]}
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is list and typing.get_args(kinds[0]) == (str,):
        return {"nargs": "+", "type": str}
    if str in kinds or typing.get_origin(annotation) is dict:
        return {"type": str}
    raise TypeError(f"option {name!r} has type {annotation}, which has no command-line form; "
                    "give it a bool, int, float or str type, or teach serving/cli.py's flag_options the new one")


def _add_option(parser: argparse.ArgumentParser, name: str, annotation: Any, default: Any, help_text: str) -> None:
    parser.add_argument("--" + name.replace("_", "-"), default=default, help=help_text.replace("%", "%%"),
                        **flag_options(name, annotation))


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field: its type from the annotation, its default and help from the field."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        _add_option(parser, f.name, hints[f.name], default, f.metadata.get("help", ""))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _generate(args: argparse.Namespace) -> int:
    from serving.llm import LLM
    from workers.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    start = time.monotonic()
    llm = LLM(config=config)
    print(f"loaded {llm.engine.model_path} in {time.monotonic() - start:.1f} s", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    prompts = args.prompt or [DEFAULT_PROMPT]
    start = time.monotonic()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.monotonic() - start
    for p, o in zip(prompts, outs):
        print(f">>> {p}\n{o.outputs[0].text}\n")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


def add_app_options(parser: argparse.ArgumentParser) -> None:
    """Serving, replica and autoscaling options, generated from `AppConfig`'s fields."""
    from serving.app_config import AppConfig

    for name, f in AppConfig.model_fields.items():
        if name != "engine":
            _add_option(parser, name, f.annotation, f.get_default(call_default_factory=True), f.description or "")


def app_config_from_args(args: argparse.Namespace) -> AppConfig:
    """The one `AppConfig` of `kvrelay serve`: the engine flags as its `EngineConfig`, the rest by name."""
    from serving.app_config import AppConfig, parse_app_args

    options = {name: getattr(args, name) for name in AppConfig.model_fields if name != "engine"}
    return parse_app_args({**options, "engine": engine_config_from_args(args)})


def _serve(args: argparse.Namespace) -> int:
    config = app_config_from_args(args)  # fails fast, before Ray starts
    from serving import direct_ingress
    from serving.ray_cluster import check_port_free, free_port, init_ray, stop_ray, wait_until_healthy

    local = not os.environ.get("RAY_ADDRESS")
    direct = args.direct_ingress
    if direct:
        if not local:
            raise ValueError("--direct-ingress starts its own local Ray cluster (its settings are read when Ray "
                             "starts), so it cannot join the cluster at RAY_ADDRESS")
        if not config.engine_runs_in_ingress:
            raise ValueError("--direct-ingress needs the engine in the ingress's one replica (engine_in_ingress), "
                             "but it runs in replicas of its own here")
    reusable = direct_ingress.can_bind_reusing_address()  # the replica's port bound as the proxy's is
    if direct is None:  # the default: wherever it can, and where the port is bound that way
        direct = local and config.engine_runs_in_ingress and reusable
    if local:  # (the running Serve of a cluster that we join may well hold the port already)
        check_port_free(args.host, args.port, reuse_addr=not direct or reusable)
    if direct:
        os.environ.update(direct_ingress.env(args.port))
    print(f"HTTP on port {args.port}: " + ("the engine's replica (direct ingress; --no-direct-ingress puts Serve's "
          "proxy there)" if direct else "Serve's proxy"), file=sys.stderr, flush=True)
    temp_dir = init_ray()
    if temp_dir is not None:
        print(f"Ray temp dir: {temp_dir} (removed on exit; KVRELAY_KEEP_RAY_TEMP=1 keeps it)", file=sys.stderr, flush=True)
    from ray import serve

    from serving.app import build_app

    signals = _StopSignals().install()
    url = f"http://{args.host}:{args.port}"
    try:
        # With direct ingress the replica listens on --port itself and Serve's proxy, which Serve needs for the
        # replica's HTTP server to start, listens on a spare port that nobody is told of.
        proxy_port = free_port() if direct else args.port
        serve.start(http_options={"host": args.host, "port": proxy_port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
        wait_until_healthy(url)
        signals.ready.set()
        print(f"kvrelay is ready: {url}/v1 (OpenAI API), {url}/metrics, {url}/health. Ctrl-C stops it.", flush=True)
        signals.requested.wait()
        _drain(config.drain_timeout_s)
    except KeyboardInterrupt:
        print("stopping now", file=sys.stderr, flush=True)
    finally:
        stop_ray(temp_dir)
    return 0


@dataclasses.dataclass
class _StopSignals:
    """SIGINT or SIGTERM once the server is ready: `requested` is set (drain, then stop). Again, or
    before the server is ready: KeyboardInterrupt (stop now)."""

    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    requested: threading.Event = dataclasses.field(default_factory=threading.Event)

    def install(self) -> _StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, *_: Any) -> None:
        if self.requested.is_set() or not self.ready.is_set():
            raise KeyboardInterrupt
        self.requested.set()


def _drain(drain_timeout_s: float) -> None:
    """Delete the app the way Serve scales down: replicas take no new requests, requests in flight get up
    to `drain_timeout_s` to finish and are then ended with an error event. Then stop Serve."""
    from ray import serve

    print(f"draining: requests in flight have up to {drain_timeout_s:g} s to finish; Ctrl-C again stops now",
          file=sys.stderr, flush=True)
    serve.delete(APP_NAME)
    serve.shutdown()
    print("stopped", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser, with subcommands per workload
        from loadtest.bench import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="kvrelay", description="LLM serving with continuous batching on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="benchmarks: burst, poisson, random, long-prompt, policies, compare, ... "
                   "(kvrelay bench --help)")
    gen = sub.add_parser("generate", help="generate offline (no server) for chat prompts",
                         formatter_class=HelpFormatter)
    add_engine_options(gen)
    gen.add_argument("--prompt", action="append",
                     help=f"a user message; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="serve the OpenAI API over HTTP on Ray Serve", formatter_class=HelpFormatter)
    add_engine_options(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=None,
                     help="the engine's replica serves HTTP on --port itself (Ray Serve's direct ingress), so a "
                     "token reaches the client without passing through Serve's proxy process; needs a local "
                     "cluster and one replica running the engine (default: on where those hold, else Serve's "
                     "proxy serves --port)")
    add_app_options(srv)
    srv.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
