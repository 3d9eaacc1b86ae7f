"""Streamed chunks: a delta with no logprobs is written from a template, byte for byte what pydantic writes for
its chunk model; the rest go through the models."""

from __future__ import annotations

import asyncio
import json

import pytest

from serving.openai_format import ResponseView, _event
from workers.outputs import CompletionOutput, Logprob, RequestOutput

TEXTS = ["", " hello", 'a "quoted" \\ back\\slash', "".join(map(chr, range(32))) + "\x7f",
         "é, 中文, 🙂, \u2028\u2029", "</script>&<'>", "\ud7ff\ue000\uffff"]


@pytest.mark.parametrize("chat", [False, True])
def test_a_plain_deltas_event_is_the_models_json_byte_for_byte(chat):
    view = ResponseView('cmpl-"x"\\1', 'a "model" é/🙂', 2, [3], chat=chat, logprobs=None)
    for i in (0, 1, 12345):
        for text in TEXTS:
            for reason in (None, "stop", "length", "abort"):
                c = CompletionOutput(i, text, [1, 2], finish_reason=reason, stop_reason=None)
                assert view._plain_event(i, c) == _event(view._chunk(i, c, 0)), (i, text, reason)


class _Stream:
    def __init__(self, outs: list[RequestOutput]) -> None:
        self.outs, self.closed = iter(outs), False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return next(self.outs)
        except StopIteration:
            raise StopAsyncIteration from None

    def close(self) -> None:
        self.closed = True


def _events(view: ResponseView, deltas: list[list[CompletionOutput]], prompt_logprobs=None) -> list[dict]:
    outs = [RequestOutput("r", None, [7, 8, 9], d, k == len(deltas) - 1,
                          prompt_logprobs=prompt_logprobs if k == 0 else None) for k, d in enumerate(deltas)]
    stream = _Stream(outs)

    async def run() -> list[str]:
        return [e async for e in view.stream([stream], include_usage=False)]

    events = asyncio.run(run())
    assert stream.closed and events[-1] == "data: [DONE]\n\n"
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


def _deltas() -> list[list[CompletionOutput]]:
    lp = lambda t: [{t: Logprob(-0.5, 1, "x")}]  # noqa: E731
    return [[CompletionOutput(0, "Hé", [5], logprobs=lp(5)), CompletionOutput(1, '"q', [6], logprobs=lp(6))],
            [CompletionOutput(0, " 🙂", [7], logprobs=lp(7), finish_reason="length")],
            [CompletionOutput(1, "\n", [8], logprobs=lp(8), finish_reason="stop")]]


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_without_logprobs_sends_each_delta_once_in_order(chat):
    got = _events(ResponseView("r1", "m", 2, [3], chat=chat, logprobs=None), _deltas())
    if chat:
        assert got[0]["choices"][0]["delta"]["role"] == "assistant"
        got = got[2:]  # the role of each choice first
    key = (lambda ch: ch["delta"]["content"]) if chat else (lambda ch: ch["text"])
    assert [(c["index"], key(c), c["finish_reason"], c["logprobs"]) for e in got for c in e["choices"]] == [
        (0, "Hé", None, None), (1, '"q', None, None), (0, " 🙂", "length", None), (1, "\n", "stop", None)]
    assert all(e["id"] == "r1" and e["model"] == "m" and e["usage"] is None for e in got)


def test_a_stream_with_logprobs_or_prompt_logprobs_shows_them():
    """Those chunks go through the models (the template has no logprobs): each delta's logprob, and the prompt's
    with the first delta only."""
    got = _events(ResponseView("r2", "m", 2, [3], chat=False, logprobs=1), _deltas())
    assert [c["logprobs"]["token_logprobs"] for e in got for c in e["choices"]] == [[-0.5]] * 4
    prompt_lps = [None, {8: Logprob(-1.0, 1, "b")}, {9: Logprob(-2.0, 1, "c")}]
    got = _events(ResponseView("r3", "m", 2, [3], chat=False, logprobs=None), _deltas(), prompt_lps)
    shown = [c["prompt_logprobs"] for e in got for c in e["choices"]]
    assert shown[0] is not None and shown[1] is not None and shown[2:] == [None, None]  # each choice's first
    assert [c["text"] for e in got for c in e["choices"]] == ["Hé", '"q', " 🙂", "\n"]
