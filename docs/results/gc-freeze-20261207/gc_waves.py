"""Waves of 256 requests x (128 prompt, 128 output tokens) through the host's path of a GPU's graph steps
(`kvrelay bench host-step --host-only`'s engine: a tiny model's forward replaced by fixed logits, decode steps
replayed from graphs by the eager stand-in, async scheduling), timing every garbage collection by generation.
The numbers in gc_waves.txt were taken with the freeze at the end of `Engine.__init__` (where it was first put),
the same point of the engine's start as here.

    KVRELAY_FREEZE_GC=0 .venv/bin/python docs/results/gc-freeze-20261207/gc_waves.py 60   # the heap not frozen
    .venv/bin/python docs/results/gc-freeze-20261207/gc_waves.py 60                       # frozen (the default)
"""
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
os.environ["TRITON_INTERPRET"] = "1"
from loadtest.host_step import BLOCK_SIZE, _prompts, host_only, write_model  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.gc_heap import freeze_startup_heap  # noqa: E402
from workers.model_loader import default_model_path  # noqa: E402
from workers.output_processor import OutputKind  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

waves, batch, plen, out = int(sys.argv[1]), 256, 128, 128
stats = {g: [0, 0.0, 0.0] for g in range(3)}  # collections, seconds, longest
started = {}


def timer(phase: str, info: dict) -> None:
    g = info["generation"]
    if phase == "start":
        started[g] = time.perf_counter()
    else:
        d = time.perf_counter() - started[g]
        stats[g][0] += 1
        stats[g][1] += d
        stats[g][2] = max(stats[g][2], d)


with tempfile.TemporaryDirectory() as tmp:
    model = write_model(Path(tmp), default_model_path(), 512)
    mml = plen + out + 64
    engine = Engine(model=model, dtype="float32", device="cpu", num_threads=1, max_num_seqs=batch,
                    max_num_batched_tokens=2048, max_model_len=mml, block_size=BLOCK_SIZE,
                    num_kv_blocks=batch * -(-mml // BLOCK_SIZE) + 16, num_speculative_tokens=0,
                    async_scheduling=True, attention_backend="triton")
    host_only(engine, batch)
    freeze_startup_heap()  # as the GPU check's and host-step's engines do (KVRELAY_FREEZE_GC=0: nothing)
    prompts = _prompts(batch, plen, engine.vocab_size, engine.vocab_size // 2)
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)

    def wave(tag: str, n: int = batch) -> None:
        for i in range(n):
            engine.add_request(f"{tag}-{i}", None, params, prompt_token_ids=prompts[i], output_kind=OutputKind.FINAL_ONLY)
        while engine.has_unfinished_requests():
            engine.step()

    wave("warm", 8)
    print(f"KVRELAY_FREEZE_GC={os.environ.get('KVRELAY_FREEZE_GC', '1')}: objects the collector walks "
          f"{len(gc.get_objects())}, frozen {gc.get_freeze_count()}")
    gc.callbacks.append(timer)
    start = time.perf_counter()
    for w in range(waves):
        wave(f"w{w}")
    total = time.perf_counter() - start
    gc.callbacks.remove(timer)
    print(f"  {waves} waves in {total:.2f} s ({waves * batch * out / total:.0f} tok/s); collections by generation "
          "(count, total ms, longest ms): "
          + ", ".join(f"gen{g} ({n}, {s * 1e3:.1f}, {m * 1e3:.1f})" for g, (n, s, m) in stats.items()))
