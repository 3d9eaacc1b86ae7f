"""`kvrelay` command line. Engine options are generated from `EngineConfig`, with vLLM's spellings."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from workers.config import EngineConfig


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                        "num_threads", "seed"):
            parser.add_argument(flag, type=int, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, default=f.default, help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _generate(args: argparse.Namespace) -> int:
    from serving.llm import LLM
    from workers.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    start = time.monotonic()
    llm = LLM(**dataclasses.asdict(config))
    print(f"loaded {llm.engine.model_path} in {time.monotonic() - start:.1f} s", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    prompts = args.prompt or ["What is continuous batching in LLM serving?"]
    start = time.monotonic()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.monotonic() - start
    for p, o in zip(prompts, outs):
        print(f">>> {p}\n{o.outputs[0].text}\n")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrelay", description="LLM serving with continuous batching on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline (no server) for chat prompts")
    add_engine_options(gen)
    gen.add_argument("--prompt", action="append", help="a user message; repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
