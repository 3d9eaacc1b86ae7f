"""What sending one tensor-parallel step to its ranks costs: `ray.put` of the step's inputs, one `execute`
call per rank on that reference, and waiting for every answer, with ranks that do no work, so what remains
is the message. Decode batches of several sizes, each request with `--context` tokens of context.

`python -m loadtest.tp_broadcast --ranks 2 --batch 1 16 64 256` prints one JSON line per batch size."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from workers.request import Request
from workers.sampling_params import SamplingParams
from workers.scheduler import SchedulerOutput
from workers.step_inputs import StepInputs, build_step_inputs


class _IdleRank:
    def execute(self, step: StepInputs) -> None:
        return None


def decode_step(batch: int, context: int, block_size: int = 16) -> StepInputs:
    """The inputs of a decode step of `batch` requests with `context` tokens each (SmolLM2-135M's head counts)."""
    reqs = []
    blocks = -(-(context + 1) // block_size)
    for i in range(batch):
        r = Request(f"r{i}", list(range(context)), SamplingParams(max_tokens=16), 16)
        r.block_ids = list(range(i * blocks, (i + 1) * blocks))
        r.num_computed_tokens = context - 1
        reqs.append(r)
    return build_step_inputs(SchedulerOutput(reqs, [1] * batch), block_size, 9, 3)


def measure(ranks: list, step: StepInputs, iterations: int) -> dict[str, float]:
    import ray

    times = []
    for _ in range(iterations + 3):
        start = time.perf_counter()
        ref = ray.put(step)
        ray.get([r.execute.remote(ref) for r in ranks])
        times.append(time.perf_counter() - start)
    times = sorted(times[3:])
    return {"median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args(argv)
    from serving.ray_cluster import init_ray, stop_ray

    temp_dir = init_ray()
    import ray

    try:
        ranks = [ray.remote(_IdleRank).options(num_cpus=0).remote() for _ in range(args.ranks)]
        ray.get([r.execute.remote(None) for r in ranks])
        for batch in args.batch:
            step = decode_step(batch, args.context)
            result = {"ranks": args.ranks, "batch": batch, "context": args.context, **measure(ranks, step, args.iterations)}
            print(json.dumps(result), flush=True)
    finally:
        stop_ray(temp_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
