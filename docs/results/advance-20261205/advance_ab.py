"""The host's work for a decode step queued ahead at batch 256, two ways: inputs built on the host and copied
into the graph's buffers (`build_ahead_inputs` + `DecodeGraphs.run`), against the buffers advanced on the device
(`ModelRunner._advance` + `DecodeGraphs.advance`). On the CPU: the "device" ops run here, and the graph's
replay is a stand-in (`eager_capture`) over a forward pass that does nothing, the same in both.

    PYTHONPATH=. .venv/bin/python docs/results/advance-20261205/advance_ab.py

Each round starts from fresh requests of 9 blocks (128-143 tokens, blocks of 16); in the advance rounds 16 of
the 256 rows take a new block every step (what staggered requests do on average)."""

import statistics
import time

import torch

from workers.cuda_graphs import DecodeGraphs, eager_capture
from workers.model_runner import ModelRunner
from workers.request import Request
from workers.sampling_params import SamplingParams
from workers.step_inputs import build_ahead_inputs

torch.set_num_threads(2)
B, BS, MAX_BLOCKS, CALLS = 256, 16, 64, 100
out = torch.zeros(B, 8)
graphs = DecodeGraphs(lambda ids, pos, meta, rows: out[:ids.shape[0]], lambda *a: a, B, MAX_BLOCKS,
                      torch.device("cpu"), capture=eager_capture)
runner = ModelRunner.__new__(ModelRunner)  # only what `_advance` reads
runner.graphs, runner.block_size = graphs, BS
tokens = torch.zeros(B, dtype=torch.long)


class After:  # the step in flight's sampled ids
    tokens = tokens


def fresh() -> list[Request]:
    p = SamplingParams(max_tokens=500, temperature=0)
    reqs = []
    for i in range(B):
        r = Request(f"r{i}", list(range(128 + i % 16)), p, 500)
        r.num_computed_tokens = len(r.all_token_ids) - 1
        r.block_ids = list(range(i * 64, i * 64 + 9))
        reqs.append(r)
    return reqs


def built(reqs, call):
    step = build_ahead_inputs(reqs, BS, 9, 3)
    graphs.run(step.input_ids, step.positions, step.common, tokens)


def advanced(reqs, call, blocks):
    for r in reqs[(call * 16) % B:(call * 16) % B + 16]:
        r.block_ids.append(r.block_ids[-1] + 1)
    assert runner._advance(reqs, After, blocks) is not None


for rnd in range(3):
    for name in ("built", "advanced"):
        reqs = fresh()
        blocks = [len(r.block_ids) for r in reqs]
        times = []
        for call in range(CALLS):
            t = time.perf_counter()
            built(reqs, call) if name == "built" else advanced(reqs, call, blocks)
            times.append(time.perf_counter() - t)
        print(f"round {rnd + 1} {name:9s} median {statistics.median(times) * 1e3:.3f} ms per step")
