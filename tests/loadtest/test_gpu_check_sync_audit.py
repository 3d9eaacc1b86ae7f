"""The GPU check's `sync_audit`: each step's synchronizing calls, by the kind of step they fell in, with the
lines that made them. On the CPU there is no sync debug mode, so a stand-in reports a call where the test
makes one; and the dry run's own stand-in, copies from pageable memory, is checked to find one."""

import warnings

import pytest

from loadtest.gpu_check.engines import make_engine, random_prompts, release_memory
from loadtest.gpu_check.plan import Plan
from loadtest.gpu_check.sync_audit import (MESSAGE, VARIED_KINDS, audit, audit_run, pageable_copies,
                                          synchronizing_calls, varied)


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


def test_the_varied_batch_is_queued_ahead_and_a_call_in_its_sampling_fails_the_section(tiny_model_dir,
                                                                                       monkeypatch) -> None:
    from workers.penalties import TokenCounts

    mode = StandIn()
    report = audit(Plan.dry(), tiny_model_dir, 64, mode)
    mixed = report["varied"]
    assert report["passed"] and mixed["steps_queued_ahead"] > 0 and mixed["decode"]["steps"] > 0
    rows = TokenCounts.rows

    def rows_calling(self, *args, **kwargs):  # the penalized rows' counts, brought up to date every step
        mode.call()
        return rows(self, *args, **kwargs)
    monkeypatch.setattr(TokenCounts, "rows", rows_calling)
    report = audit(Plan.dry(), tiny_model_dir, 64, mode)
    assert not report["passed"] and report["decode"]["synchronizing_calls"] == 0
    assert report["varied"]["decode"]["synchronizing_calls"] >= report["varied"]["decode"]["steps"] > 0


def test_the_varied_batch_has_every_kind_of_sampling() -> None:
    params = varied(40, 2 * len(VARIED_KINDS))
    assert {p.seed for p in params if p.temperature == 0} == {None}
    assert len({p.seed for p in params if p.seed is not None}) == 4 and any(
        p.seed is None and p.temperature > 0 for p in params)
    assert any(p.penalizes for p in params) and any(p.logit_bias for p in params) and any(p.bad_words for p in params)
    assert any(p.min_tokens == 20 and p.stop_token_ids for p in params) and any(p.logprobs for p in params)
    assert any(p.top_k > 0 and p.top_p < 1 for p in params) and any(p.min_p > 0 for p in params)
    assert all(p.max_tokens == 40 and p.ignore_eos for p in params)


def test_on_the_cpu_a_tensor_made_on_the_device_from_host_data_stands_in_for_a_synchronizing_call(
        tiny_model_dir, monkeypatch) -> None:
    """The dry run's stand-in for the sync debug mode (`pageable_copies`): the engine's steps make no tensor
    from host data with `device=` (on a GPU a copy from pageable memory, which waits for the device); one made
    in the varied batch's sampling is reported at its line and fails the section."""
    import torch

    from workers import sampler

    with synchronizing_calls(pageable_copies()) as calls:
        torch.zeros(3, device="cpu")  # a tensor made on the device, not copied there: not a call
        torch.tensor([1, 2])  # made on the host
        torch.tensor([1, 2], device="cpu")  # the call
    assert len(calls) == 1 and calls[0].filename == __file__
    assert audit(Plan.dry(), tiny_model_dir, 64)["passed"]
    mask = sampler._mask_banned

    def mask_copying(logits, banned, *args):  # bans copied to the device as `_mask_banned` once did
        torch.tensor([t for b in banned if b for t in b], device=logits.device)
        return mask(logits, banned, *args)
    monkeypatch.setattr(sampler, "_mask_banned", mask_copying)
    report = audit(Plan.dry(), tiny_model_dir, 64)
    assert not report["passed"] and report["decode"]["synchronizing_calls"] == 0
    [site] = report["varied"]["decode"]["sites"]
    assert "test_gpu_check_sync_audit.py" in site["site"] and "torch.tensor" in site["site"]
