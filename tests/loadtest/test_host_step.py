"""`kvrelay bench host-step`: the phases of a decode step are timed where the engine calls them, and the
engine is left as it was."""

from __future__ import annotations

import pytest

from loadtest import host_step
from workers import model_runner
from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.sampler import PendingSample


def test_decode_steps_are_split_into_phases_and_the_engine_is_left_as_it_was(tmp_path, default_model_dir):
    model = host_step.write_model(tmp_path / "m", default_model_dir, vocab_size=512)
    engine = Engine(model=model, dtype="float32", max_num_seqs=4, kv_cache_memory="16MiB", num_threads=1,
                    num_speculative_tokens=0, max_model_len=128)
    prompts = host_step._prompts(4, 8, engine.vocab_size)
    build, sample, ahead = model_runner.build_step_inputs, model_runner.launch_sample, model_runner.build_ahead_inputs
    result_fn = PendingSample.result
    result = host_step.measure(engine, prompts, 3, OutputKind.DELTA, profile=True)
    ms = result["ms_per_step"]
    assert result["decode_steps"] == 3 and result["scheduled_steps"] == 3
    assert all(ms[k] > 0 for k in host_step.PHASES)
    assert abs(ms["step"] - sum(ms[k] for k in host_step.PHASES) - ms["other"]) < 1e-3  # each rounded to 0.1 us
    assert abs(ms["host"] - (ms["step"] - ms["forward"] - ms["sample"])) < 1e-3
    assert result["profile_top_own_time"] and sum(result["gc_collections_by_generation"]) >= 0
    # the thread's CPU time: never more than the wall time, but for the two clocks' disagreement and the clock
    # reads inside the CPU interval (in full test runs on a 2-core VM the CPU clock read 0.7% more, 1.858 against
    # 1.845 ms, and once, beside a second pytest process, more than 2% + 10 us in a phase)
    cpu = result["thread_cpu_ms_per_step"]
    assert set(cpu) == {"step", *host_step.CPU_PHASES}
    assert all(0 < cpu[k] <= ms[k] * 1.05 + 0.02 for k in cpu), (cpu, ms)
    # the wrappers are gone and nothing is left running
    assert model_runner.build_step_inputs is build and model_runner.launch_sample is sample
    assert model_runner.build_ahead_inputs is ahead and PendingSample.result is result_fn
    for obj, name in ((engine.scheduler, "schedule"), (engine.scheduler, "update_from_output"),
                      (engine.runner, "_forward"), (engine.outputs, "process")):
        assert name not in vars(obj)
    assert not engine.has_unfinished_requests() and engine.kv_cache.pool.num_free_blocks == engine.num_kv_blocks
    # and it measures again, with every request penalized and with bad words too
    assert host_step.measure(engine, prompts, 2, OutputKind.FINAL_ONLY)["decode_steps"] == 2
    assert host_step.measure(engine, prompts, 2, OutputKind.FINAL_ONLY, frequency_penalty=0.2,
                             bad_words=["in", "at is"])["decode_steps"] == 2


@pytest.mark.parametrize("ahead", [False, True])
def test_steps_that_replay_decode_graphs_count_the_replay_as_forward(tmp_path, default_model_dir, ahead):
    """With decode graphs (replayed eagerly on the CPU, as in the GPU check's dry run) a decode step calls
    the graphs instead of the model: that call is the step's forward, and so is advancing the graph step
    before on the device, as steps queued ahead do (`DecodeGraphs.advance`)."""
    from workers.cuda_graphs import eager_capture

    model = host_step.write_model(tmp_path / "m", default_model_dir, vocab_size=512)
    engine = Engine(model=model, dtype="float32", max_num_seqs=4, kv_cache_memory="16MiB", num_threads=1,
                    num_speculative_tokens=0, max_model_len=128, attention_backend="triton", async_scheduling=ahead)
    engine.runner.enable_decode_graphs(4, engine.max_model_len, capture=eager_capture)
    graphs = engine.runner.graphs
    result = host_step.measure(engine, host_step._prompts(4, 8, engine.vocab_size), 3, OutputKind.FINAL_ONLY)
    assert result["decode_steps"] == 3 and result["ms_per_step"]["forward"] > 0
    assert (graphs.steps_advanced >= 2) == ahead
    assert "run" not in vars(graphs) and "advance" not in vars(graphs)  # the wrappers are gone


def test_steps_queued_ahead_are_split_into_the_same_phases(tmp_path, default_model_dir):
    """With async scheduling a decode step is not scheduled: it builds the next step's inputs (step_inputs),
    runs it (forward, sample) and waits for its own tokens (sample)."""
    model = host_step.write_model(tmp_path / "m", default_model_dir, vocab_size=512)
    engine = Engine(model=model, dtype="float32", max_num_seqs=4, kv_cache_memory="16MiB", num_threads=1,
                    num_speculative_tokens=0, max_model_len=128, async_scheduling=True)
    result = host_step.measure(engine, host_step._prompts(4, 8, engine.vocab_size), 4, OutputKind.FINAL_ONLY)
    ms = result["ms_per_step"]
    assert result["decode_steps"] == 4 and result["scheduled_steps"] <= 1  # the first, after the prefill
    assert all(ms[k] > 0 for k in ("step_inputs", "forward", "sample", "update", "outputs"))
    assert not engine.has_unfinished_requests() and engine.kv_cache.pool.num_free_blocks == engine.num_kv_blocks


def test_the_module_runs_on_its_own(tmp_path, default_model_dir, capsys):
    assert host_step.main(["--batch", "4", "--prompt-len", "8", "--steps", "2", "--rounds", "1", "--vocab-size", "512",
                           "--tokenizer", default_model_dir, "--threads", "1", "--out", str(tmp_path)]) == 0
    assert "median ms per decode step at batch 4" in capsys.readouterr().out
    assert len(list(tmp_path.glob("host-step-*.json"))) == 1


def test_host_only_runs_the_graph_path_without_the_model(tmp_path, default_model_dir, capsys, monkeypatch):
    """`--host-only`: the forward pass replaced by fixed logits and decode graphs replayed by the stand-in, so
    that steps queued ahead advance the graph's buffers as on a GPU; the run's JSON says so. The model never
    runs, in the warm-up or after it (each round's timers put the replaced forward back)."""
    import json

    from workers.cuda_graphs import DecodeGraphs

    def model_ran(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(model_runner.ModelRunner, "_forward", model_ran)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    advance, advanced = DecodeGraphs.advance, []
    monkeypatch.setattr(DecodeGraphs, "advance", lambda self, *a: advanced.append(a[0]) or advance(self, *a))
    assert host_step.main(["--batch", "4", "--prompt-len", "8", "--steps", "3", "--rounds", "1", "--vocab-size", "512",
                           "--tokenizer", default_model_dir, "--threads", "1", "--async-scheduling", "--host-only",
                           "--output-kind", "final", "--out", str(tmp_path)]) == 0
    assert "median ms per decode step at batch 4" in capsys.readouterr().out
    report = json.loads(next(tmp_path.glob("host-step-*.json")).read_text())
    assert report["host_only"] and report["async_scheduling"] and advanced and set(advanced) == {4}
    assert report["gc_frozen_objects"] > 0  # the heap frozen once the engine was built, as a replica's is
