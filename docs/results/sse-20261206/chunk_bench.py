"""One streamed delta's SSE event (no logprobs), through the chunk models (`_event(view._chunk(...))`) and from
the template (`view._plain_event`), per event.

    PYTHONPATH=. .venv/bin/python docs/results/sse-20261206/chunk_bench.py"""
import timeit

from serving.openai_format import ResponseView, _event
from workers.outputs import CompletionOutput

for chat in (False, True):
    v = ResponseView("cmpl-0123456789abcdef", "HuggingFaceTB/SmolLM2-135M-Instruct", 1, [3], chat=chat, logprobs=None)
    c = CompletionOutput(0, " hello", [1])
    assert v._plain_event(0, c) == _event(v._chunk(0, c, 0))
    a = timeit.timeit(lambda: _event(v._chunk(0, c, 0)), number=20000) / 20000 * 1e6
    b = timeit.timeit(lambda: v._plain_event(0, c), number=20000) / 20000 * 1e6
    print("chat" if chat else "completion", f"models {a:.2f} us, template {b:.2f} us")
