"""The `kvrelay bench` commands that run no system: `train-predictor` (the `predicted` policy's length
model), `compare` (result JSONs side by side) and `plot`. The command line is in loadtest/bench.py; the
workload runners are in loadtest/runners.py."""

from __future__ import annotations

import argparse
import json

from loadtest import report
from loadtest.runners import default_model_path


def run_train_predictor(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from loadtest.predictor import DEFAULT_PREDICTOR, collect_lengths, format_report, train
    from loadtest.workloads import poisson_requests

    model = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model)
    output = args.output or DEFAULT_PREDICTOR
    lengths_path = output.with_name(output.stem + "-lengths.json")
    if args.lengths:
        data = json.loads(args.lengths.read_text(encoding="utf-8"))
        data["prompts"] = [r.prompt_token_ids for r in poisson_requests(tokenizer, 1.0, num_requests=len(data["lengths"]))]
    else:
        from serving import LLM

        data = collect_lengths(LLM(model=model, dtype=args.dtype), tokenizer, args.num_prompts)
        lengths_path.parent.mkdir(parents=True, exist_ok=True)
        lengths_path.write_text(json.dumps({k: v for k, v in data.items() if k != "prompts"}) + "\n", encoding="utf-8")
        print(f"wrote {lengths_path}")
    predictor, result = train(data)
    predictor.save(output)
    print(format_report(result))
    print(f"wrote {output}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    payloads = [(f.stem, report.load_payload(f)) for f in args.files]
    print(report.compare_table(payloads, args.baseline))
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from loadtest.plots import plot_payload, plot_together

    if args.together is not None:
        labels = args.labels.split(",") if args.labels is not None else None
        pngs = plot_together([report.load_payload(f) for f in args.files], labels, args.together)
    elif args.labels is not None:
        raise ValueError("--labels names the files of --together; give --together STEM too")
    else:
        pngs = [png for f in args.files for png in plot_payload(report.load_payload(f), f)]
    for png in pngs:
        print(f"wrote {png}")
    return 0
