"""`merge_deltas`: two delta outputs of one request as one (what a stream behind the engine sends)."""

from __future__ import annotations

import copy

from workers.outputs import CompletionOutput, Logprob, RequestOutput, merge_deltas


def _lp(t: int) -> dict[int, Logprob]:
    return {t: Logprob(-0.5, 1, f"<{t}>")}


def test_each_sequence_joins_its_text_tokens_and_logprobs_and_takes_the_later_finish():
    prompt_lps = [None, _lp(9)]
    first = RequestOutput("r", "hi", [8, 9], [CompletionOutput(0, "a", [1], -0.5, [_lp(1)]),
                                              CompletionOutput(1, "x", [7], -0.5, [_lp(7)])],
                          False, 0, {"arrival_time": 1.0}, prompt_lps)
    later = RequestOutput("r", None, [8, 9], [CompletionOutput(1, "yz", [5, 6], -1.5, [_lp(5), _lp(6)], "stop", "z"),
                                              CompletionOutput(2, "q", [4], -0.5, [_lp(4)])],
                          True, 2, {"first_token_time": 2.0})
    before = copy.deepcopy((first, later))
    merged = merge_deltas(first, later)
    assert (first, later) == before  # neither input changed
    assert [c.index for c in merged.outputs] == [0, 1, 2]
    a, b, c = merged.outputs
    assert a == first.outputs[0]  # nothing new for sequence 0
    assert (b.text, b.token_ids, b.cumulative_logprob, b.finish_reason, b.stop_reason) == ("xyz", [7, 5, 6], -1.5,
                                                                                            "stop", "z")
    assert b.logprobs == [_lp(7), _lp(5), _lp(6)]
    assert c == later.outputs[1]
    assert merged.finished and merged.num_cached_tokens == 2 and merged.prompt == "hi"
    assert merged.prompt_logprobs == prompt_lps  # sent with the first delta only
    assert merged.metrics == {"arrival_time": 1.0, "first_token_time": 2.0}


def test_without_logprobs_they_stay_none_and_an_earlier_finish_is_kept():
    first = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [1])], False)
    later = RequestOutput("r", None, [1], [CompletionOutput(0, "", [], finish_reason=None)], False)
    merged = merge_deltas(first, later)
    assert merged.outputs[0].logprobs is None and merged.outputs[0].token_ids == [1]
    ended = merge_deltas(RequestOutput("r", None, [1], [CompletionOutput(0, "a", [1], finish_reason="stop")], False),
                         later)
    assert ended.outputs[0].finish_reason == "stop"
