"""`stream_interval`: a streamed (delta) request reports its first token at once, then its new tokens every
`stream_interval` of them, and whatever is left with its end; the tokens and text are those of
`stream_interval=1`. Other output kinds are unchanged."""

from __future__ import annotations

import pytest

from workers.config import EngineConfig
from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.sampling_params import SamplingParams

PROMPTS = {"a": [1, 5, 9, 200, 3000, 7], "b": list(range(100, 140))}


def _run(tiny_model_dir: str, interval: int, kind: OutputKind = OutputKind.DELTA, n: int = 1,
         max_tokens: int = 10) -> dict[str, list]:
    engine = Engine(model=tiny_model_dir, dtype="float32", num_kv_blocks=64, num_threads=1, stream_interval=interval)
    for rid, prompt in PROMPTS.items():
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)
        engine.add_request(rid, None, params, prompt_token_ids=prompt, output_kind=kind)
    outputs: dict[str, list] = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.get_stats().kv_cache_usage == 0
    return outputs


@pytest.mark.parametrize("interval", [3, 4, 20])
def test_deltas_come_every_interval_tokens_and_add_up_to_the_same_completion(tiny_model_dir, interval):
    each = _run(tiny_model_dir, 1)
    grouped = _run(tiny_model_dir, interval)
    for rid in PROMPTS:
        sizes = [len(o.outputs[0].token_ids) for o in grouped[rid]]
        rest = (10 - 1) % interval
        assert sizes == [1] + [interval] * ((10 - 1) // interval) + ([rest] if rest else [])
        assert [o.finished for o in grouped[rid]] == [False] * (len(sizes) - 1) + [True]
        assert len(each[rid]) == 10
        for outs in (each[rid], grouped[rid]):
            assert [t for o in outs for t in o.outputs[0].token_ids] == [t for o in each[rid] for t in o.outputs[0].token_ids]
            assert "".join(o.outputs[0].text for o in outs) == "".join(o.outputs[0].text for o in each[rid])

def test_every_sequence_of_a_group_keeps_its_tokens(tiny_model_dir):
    each, grouped = _run(tiny_model_dir, 1, n=2), _run(tiny_model_dir, 4, n=2)
    for rid in PROMPTS:
        for i in range(2):
            tokens = [[t for o in outs for t in o.outputs[i].token_ids] for outs in (each[rid], grouped[rid])]
            assert tokens[0] == tokens[1] and len(tokens[0]) == 10
        assert len(grouped[rid]) <= 5 < len(each[rid])  # each sequence's first token at once, then 4 at a time


def test_cumulative_and_final_outputs_ignore_the_interval(tiny_model_dir):
    assert [len(v) for v in _run(tiny_model_dir, 4, OutputKind.CUMULATIVE).values()] == [10, 10]
    assert [len(v) for v in _run(tiny_model_dir, 4, OutputKind.FINAL_ONLY).values()] == [1, 1]


def test_final_only_text_decoded_at_the_end_is_the_streamed_text(tiny_model_dir):
    """A final-only request's tokens are decoded once it ends (`IncrementalDetokenizer(defer=True)`, in one
    window): the same text as streamed token by token, for each sequence of an `n=2` request, over a random
    model's tokens (characters split across tokens included)."""
    streamed = _run(tiny_model_dir, 1, n=2, max_tokens=40)
    final = _run(tiny_model_dir, 1, OutputKind.FINAL_ONLY, n=2, max_tokens=40)
    split = 0
    for rid in PROMPTS:
        (out,) = final[rid]
        for i in range(2):
            text = "".join(o.outputs[i].text for o in streamed[rid])
            assert out.outputs[i].text == text and out.outputs[i].token_ids == [
                t for o in streamed[rid] for t in o.outputs[i].token_ids]
            split += any(o.outputs[i].token_ids and not o.outputs[i].text for o in streamed[rid])
    assert split  # some step's token left its character incomplete, so the window had something to wait for


def test_the_interval_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            EngineConfig(stream_interval=bad)


@pytest.mark.parametrize("interval", [1, 3])
def test_deltas_with_logprobs_add_up_to_the_final_output(tiny_model_dir, interval):
    """A streamed request of one sequence with logprobs and prompt logprobs (each step's delta made by
    `OutputProcessor._make_delta`): its deltas' tokens, text and logprobs add up to the final-only output's,
    the prompt logprobs come once, with the first, and only the last is finished, with the cumulative logprob."""
    def run(kind: OutputKind, interval: int) -> dict[str, list]:
        engine = Engine(model=tiny_model_dir, dtype="float32", num_kv_blocks=64, num_threads=1,
                        stream_interval=interval)
        for rid, prompt in PROMPTS.items():
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
            engine.add_request(rid, None, params, prompt_token_ids=prompt, output_kind=kind)
        outputs: dict[str, list] = {rid: [] for rid in PROMPTS}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id].append(out)
        return outputs

    deltas, final = run(OutputKind.DELTA, interval), run(OutputKind.FINAL_ONLY, interval)
    for rid, prompt in PROMPTS.items():
        outs, (whole,) = deltas[rid], final[rid]
        assert len(outs) == (8 if interval == 1 else 4)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        seqs = [o.outputs[0] for o in outs]
        assert [t for s in seqs for t in s.token_ids] == whole.outputs[0].token_ids
        assert "".join(s.text for s in seqs) == whole.outputs[0].text
        assert [lp for s in seqs for lp in s.logprobs] == whole.outputs[0].logprobs
        assert seqs[-1].cumulative_logprob == pytest.approx(whole.outputs[0].cumulative_logprob)
        assert seqs[-1].finish_reason == "length" and all(s.finish_reason is None for s in seqs[:-1])
        assert outs[0].prompt_logprobs == whole.prompt_logprobs and len(whole.prompt_logprobs) == len(prompt)
        assert all(o.prompt_logprobs is None for o in outs[1:])
