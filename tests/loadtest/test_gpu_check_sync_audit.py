"""The GPU check's `sync_audit`: each step's synchronizing calls, by the kind of step they fell in, with the
lines that made them. On the CPU there is no sync debug mode, so a stand-in reports a call where the test
makes one."""

import warnings

import pytest

from loadtest.gpu_check.engines import make_engine, random_prompts, release_memory
from loadtest.gpu_check.plan import Plan
from loadtest.gpu_check.sync_audit import MESSAGE, audit, audit_run, synchronizing_calls


class StandIn:
    """torch's sync debug mode as the audit sets it; `call()` is a synchronizing call while it is on."""

    def __init__(self) -> None:
        self.mode, self.modes = 0, []

    def __call__(self, mode: int) -> None:
        self.mode = mode
        self.modes.append(mode)

    def call(self) -> None:
        if self.mode:
            warnings.warn(f"called a {MESSAGE}")  # the site the audit must name: this line


def test_every_call_is_kept_and_other_warnings_are_not_counted() -> None:
    mode = StandIn()
    with synchronizing_calls(mode) as calls:
        for _ in range(3):
            mode.call()  # one line, three calls: each kept, not only the first
        warnings.warn("something else")
    assert len(calls) == 3 and mode.modes == [1, 0]
    mode.call()  # the mode is off again
    assert len(calls) == 3


@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_a_steps_calls_are_counted_by_its_kind_with_their_line(tiny_model_dir, where) -> None:
    plan = Plan.dry()
    engine = make_engine(plan, tiny_model_dir, "float32", "cpu", "triton", True, max_num_seqs=4, async_scheduling=True)
    mode = StandIn()
    update = engine.scheduler.update_from_output

    def update_calling(*args, **kwargs):  # a synchronizing call in the steps of one kind
        decode_only = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)
        if decode_only == (where == "decode"):
            mode.call()
        return update(*args, **kwargs)
    engine.scheduler.update_from_output = update_calling
    report = audit_run(engine, random_prompts(4, 8, 64, seed=1), 6, mode)
    assert report["decode"]["steps"] >= 3 and report["other"]["steps"] >= 1
    hit, clean = (report["decode"], report["other"]) if where == "decode" else (report["other"], report["decode"])
    assert hit["synchronizing_calls"] >= 1 and clean["synchronizing_calls"] == 0 and not clean["sites"]
    [site] = hit["sites"]
    assert site["site"].startswith("tests/loadtest/test_gpu_check_sync_audit.py:") and "warnings.warn" in site["site"]
    assert site["calls"] == hit["synchronizing_calls"]
    del engine, update, update_calling
    release_memory()  # thawed and collected: the CPU's graph stand-in holds its runner in a cycle


def test_the_section_fails_on_a_call_in_a_decode_step_and_passes_without(tiny_model_dir, monkeypatch) -> None:
    from workers import model_runner

    mode = StandIn()
    assert audit(Plan.dry(), tiny_model_dir, 64, mode)["passed"]
    greedy = model_runner.launch_greedy

    def greedy_calling(*args, **kwargs):  # the sampling of every step of plain greedy rows, decode steps included
        mode.call()
        return greedy(*args, **kwargs)
    monkeypatch.setattr(model_runner, "launch_greedy", greedy_calling)
    report = audit(Plan.dry(), tiny_model_dir, 64, mode)
    assert not report["passed"] and report["decode"]["synchronizing_calls"] >= report["decode"]["steps"] > 0


def test_the_penalized_batch_is_queued_ahead_and_a_call_in_its_sampling_fails_the_section(tiny_model_dir,
                                                                                          monkeypatch) -> None:
    from workers.penalties import TokenCounts

    mode = StandIn()
    report = audit(Plan.dry(), tiny_model_dir, 64, mode)
    pen = report["penalized"]
    assert report["passed"] and pen["steps_queued_ahead"] > 0 and pen["decode"]["steps"] > 0
    rows = TokenCounts.rows

    def rows_calling(self, *args, **kwargs):  # the penalized rows' counts, brought up to date every step
        mode.call()
        return rows(self, *args, **kwargs)
    monkeypatch.setattr(TokenCounts, "rows", rows_calling)
    report = audit(Plan.dry(), tiny_model_dir, 64, mode)
    assert not report["passed"] and report["decode"]["synchronizing_calls"] == 0
    assert report["penalized"]["decode"]["synchronizing_calls"] >= report["penalized"]["decode"]["steps"] > 0
