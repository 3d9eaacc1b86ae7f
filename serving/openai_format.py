"""Engine outputs to OpenAI responses: accumulate deltas per choice, render logprobs both ways, turn tool
output into `tool_calls`, stream SSE.

Completions with `echo` start each choice with its prompt: the text, and with logprobs the prompt's tokens
and their logprobs (the first token's null), as vLLM does; `max_tokens: 0` shows the prompt alone."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from fastapi.responses import StreamingResponse

from serving.engine_client import EngineError, RequestStream
from serving.errors import OpenAIError
from serving.protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk, ChatCompletionResponse,
                              ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, CompletionChoice,
                              CompletionChunk, CompletionLogprobs, CompletionResponse, DeltaFunctionCall, DeltaMessage,
                              DeltaToolCall, PromptLogprob, PromptLogprobs, TopLogprob, Usage)
from serving.tool_calls import ToolMode, ToolPlan, finish_reason, new_call_id, parse_tool_calls
from workers.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass(slots=True)
class ChoiceState:
    """Everything a choice has received so far; `finish_reason` set once it ended."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def _chosen(entry: dict[int, Logprob], token: int) -> Logprob:
    return entry[token]


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int,
                        text_offset: int = 0, decode: Callable[[list[int]], str] | None = None) -> CompletionLogprobs:
    """Legacy completions format: parallel lists, offsets counted from `text_offset`. A None entry (an
    echoed prompt's first token) has null logprobs, its text from `decode`."""
    out = CompletionLogprobs()
    offset = text_offset
    for token, entry in zip(token_ids, entries):
        if entry is None:
            text = decode([token]) if decode else ""
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            continue
        chosen = _chosen(entry, token)
        text = chosen.decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(chosen.logprob)
        top = {lp.decoded_token or "": lp.logprob for lp in _top(entry, k)}
        top.setdefault(text, chosen.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> ChatChoiceLogprobs:
    """Chat format: one object per token with its top alternatives."""
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = _chosen(entry, token)
        text = chosen.decoded_token or ""
        top = [TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                          bytes=list((lp.decoded_token or "").encode())) for lp in _top(entry, k)]
        content.append(ChatTokenLogprob(token=text, logprob=chosen.logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def _prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    if entries is None:
        return None
    return [None if e is None else {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                                    for t, lp in e.items()} for e in entries]


@dataclass(slots=True)
class _Echo:
    texts: list[str]
    token_ids: list[list[int]]
    only: bool  # max_tokens 0: the prompt alone
    decode: Callable[[list[int]], str]


class ResponseView:
    """One OpenAI request's view of its engine requests: indexes choices, accumulates, renders."""

    def __init__(self, request_id: str, model: str, n: int, prompt_lens: list[int], chat: bool,
                 logprobs: int | None, tools: ToolPlan | None = None) -> None:
        self.request_id, self.model, self.n, self.chat, self.k = request_id, model, n, chat, logprobs
        self.tools = tools if tools is not None and tools.calls_tools else None
        self._named_started: set[int] = set()
        self.prompt_lens = prompt_lens
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(n * len(prompt_lens))]
        self.prompt_logprobs: list[list[dict[int, Logprob] | None] | None] = [None] * len(prompt_lens)
        self._echo: _Echo | None = None
        self._echoed: set[int] = set()  # streamed choices whose prompt went out already
        self._plain: tuple[str, str, str, str] | None = None  # `_plain_event`'s template, made on first use

    def echo(self, texts: list[str], token_ids: list[list[int]], only: bool, decode: Callable[[list[int]], str]) -> None:
        """Start every choice with its prompt (completions `echo`); `only`: nothing after it."""
        self._echo = _Echo(texts, token_ids, only, decode)

    def _with_prompt(self, p: int, c: CompletionOutput, first: bool) -> CompletionOutput:
        """`c` as shown with echo: the prompt before the first delta, generated tokens dropped if `only`."""
        e = self._echo
        if e is None:
            return c
        text, ids, lps = ("", [], []) if e.only else (c.text, c.token_ids, c.logprobs or [])
        if first:
            prompt_lps = self.prompt_logprobs[p] or [None] * len(e.token_ids[p])
            text, ids, lps = e.texts[p] + text, e.token_ids[p] + ids, prompt_lps + lps
        return replace(c, text=text, token_ids=ids, logprobs=lps)

    def _record(self, p: int, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[p] = out.prompt_logprobs

    def usage(self) -> Usage:
        prompt = sum(self.prompt_lens)
        completion = 0 if self._echo and self._echo.only else sum(len(c.token_ids) for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def collect(self, streams: list[RequestStream]):
        async def drain(p: int, stream: RequestStream) -> None:
            async for out in stream:
                self._record(p, out)
                for c in out.outputs:
                    self.choices[p * self.n + c.index].add(c)

        try:
            await asyncio.gather(*(drain(p, s) for p, s in enumerate(streams)))
        except EngineError as e:
            raise OpenAIError.from_engine(e) from None
        finally:
            for s in streams:
                s.close()
        if self.chat:
            choices = []
            for i, c in enumerate(self.choices):
                content, calls = parse_tool_calls(self.tools, c.text) if self.tools else (c.text, [])
                choices.append(ChatCompletionChoice(
                    index=i, message=ChatResponseMessage(content=content, tool_calls=calls),
                    finish_reason=finish_reason(self.tools, calls, c.finish_reason) if self.tools else c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=None if self.k is None else chat_logprobs(c.token_ids, c.logprobs, self.k)))
            return ChatCompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=self.usage(),
                                          prompt_logprobs=_prompt_logprobs_json(self.prompt_logprobs[0]))
        choices = []
        for i, state in enumerate(self.choices):
            p = i // self.n
            c = self._with_prompt(p, CompletionOutput(i, state.text, state.token_ids, None, state.logprobs), True)
            choices.append(CompletionChoice(
                index=i, text=c.text, finish_reason=state.finish_reason, stop_reason=state.stop_reason,
                prompt_logprobs=_prompt_logprobs_json(self.prompt_logprobs[p]),
                logprobs=None if self.k is None else completion_logprobs(c.token_ids, c.logprobs, self.k,
                                                                         decode=self._decode)))
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=self.usage())

    @property
    def _decode(self) -> Callable[[list[int]], str] | None:
        return None if self._echo is None else self._echo.decode

    async def stream(self, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        """SSE events: one per choice per engine step, then usage if asked, then `[DONE]`."""
        try:
            if self.chat:
                for i in range(len(self.choices)):
                    yield _event(ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
                        ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]))
            async for p, out in _merge(streams):
                self._record(p, out)
                for c in out.outputs:
                    i = p * self.n + c.index
                    state = self.choices[i]
                    if state.finish_reason is not None or (not c.token_ids and c.finish_reason is None):
                        continue
                    first = i not in self._echoed
                    self._echoed.add(i)
                    offset = len(state.text) + (len(self._echo.texts[p]) if self._echo and not first else 0)
                    state.add(c)
                    if self.tools is not None:
                        for chunk in self._tool_chunks(i, c, state, offset):
                            yield _event(chunk)
                    elif self.k is None and (not first or self.prompt_logprobs[p] is None):
                        yield self._plain_event(i, self._with_prompt(p, c, first))
                    else:
                        yield _event(self._chunk(i, self._with_prompt(p, c, first), offset,
                                                 self.prompt_logprobs[p] if first else None))
            if include_usage:
                chunk_cls = ChatCompletionChunk if self.chat else CompletionChunk
                yield _event(chunk_cls(id=self.request_id, created=self.created, model=self.model, choices=[],
                                       usage=self.usage()))
        except EngineError as e:
            yield OpenAIError.from_engine(e).sse()
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"

    def _tool_chunks(self, i: int, c, state: ChoiceState, offset: int) -> list[ChatCompletionChunk]:
        """A named call streams its arguments as they come (the name first); "required" and "auto" output
        is parsed when the choice ends, then sent as one delta of content and/or tool calls."""
        def chunk(delta: DeltaMessage, reason: str | None = None, lp=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
                ChatStreamChoice(index=i, delta=delta, logprobs=lp, finish_reason=reason)])

        lp = None if self.k is None else chat_logprobs(c.token_ids, c.logprobs or [], self.k)
        if self.tools.mode is ToolMode.NAMED:
            chunks = []
            if i not in self._named_started:
                self._named_started.add(i)
                chunks.append(chunk(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=0, id=new_call_id(), type="function",
                    function=DeltaFunctionCall(name=self.tools.name, arguments=""))])))
            chunks.append(chunk(DeltaMessage(tool_calls=[DeltaToolCall(
                index=0, function=DeltaFunctionCall(arguments=c.text))]), c.finish_reason, lp))
            return chunks
        if c.finish_reason is None:
            return [chunk(DeltaMessage(), None, lp)] if lp is not None else []
        content, calls = parse_tool_calls(self.tools, state.text)
        deltas = [DeltaToolCall(index=j, id=call.id, type="function",
                                function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
                  for j, call in enumerate(calls)]
        delta = DeltaMessage(content=content or None, tool_calls=deltas or None)
        return [chunk(delta, finish_reason(self.tools, calls, c.finish_reason), lp)]

    def _plain_event(self, i: int, c: CompletionOutput) -> str:
        """`_event(self._chunk(i, c, ...))` of a delta with no logprobs to show, byte for byte, written into the
        JSON that pydantic wrote for a chunk of marks: the chunk model's fields and their order are then pydantic's
        own, and a streamed token costs two string escapes, not a model built, validated and dumped (0.27 us
        against ~6 on a 2-core Zen 4; a stream at a GPU's rate sends one a token)."""
        if self._plain is None:
            marks = CompletionOutput(0, _TEXT_MARK, [], finish_reason=_FINISH_MARK)
            marked = _event(self._chunk(_INDEX_MARK, marks, 0))
            head, _, rest = marked.rpartition(f'"index":{_INDEX_MARK}')
            between, _, rest = rest.rpartition(_json_str(_TEXT_MARK))
            before_finish, _, tail = rest.rpartition(_json_str(_FINISH_MARK))
            self._plain = (f'{head}"index":', between, before_finish, tail)
        head, between, before_finish, tail = self._plain
        reason = "null" if c.finish_reason is None else _json_str(c.finish_reason)
        return f"{head}{i}{between}{_json_str(c.text)}{before_finish}{reason}{tail}"

    def _chunk(self, i: int, c, offset: int, prompt_logprobs=None):
        if self.chat:
            lp = None if self.k is None else chat_logprobs(c.token_ids, c.logprobs or [], self.k)
            return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
                ChatStreamChoice(index=i, delta=DeltaMessage(content=c.text), logprobs=lp, finish_reason=c.finish_reason)])
        lp = None if self.k is None else completion_logprobs(c.token_ids, c.logprobs or [], self.k, offset, self._decode)
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
            CompletionChoice(index=i, text=c.text, logprobs=lp, finish_reason=c.finish_reason,
                             prompt_logprobs=_prompt_logprobs_json(prompt_logprobs))])


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams, tagging each delta with its stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(p: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((p, out))
        except EngineError as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, EngineError):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


# strings as pydantic's JSON writes them (UTF-8 kept, control characters escaped); `_plain_event`'s marks
_json_str = json.JSONEncoder(ensure_ascii=False).encode
_INDEX_MARK, _TEXT_MARK, _FINISH_MARK = -987_654_321, "\0kvrelay text\0", "\0kvrelay finish\0"


def _event(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
