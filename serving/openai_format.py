"""Engine outputs to OpenAI responses: accumulate deltas per choice, render logprobs both ways, turn tool
output into `tool_calls`, stream SSE."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from serving.engine_client import EngineError, RequestStream
from serving.errors import OpenAIError
from serving.protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk, ChatCompletionResponse,
                              ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, CompletionChoice,
                              CompletionChunk, CompletionLogprobs, CompletionResponse, DeltaFunctionCall, DeltaMessage,
                              DeltaToolCall, TopLogprob, Usage)
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


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """Legacy completions format: parallel lists, offsets counted from `text_offset`."""
    out = CompletionLogprobs()
    offset = text_offset
    for token, entry in zip(token_ids, entries):
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

    def usage(self) -> Usage:
        prompt = sum(self.prompt_lens)
        completion = sum(len(c.token_ids) for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def collect(self, streams: list[RequestStream]):
        async def drain(p: int, stream: RequestStream) -> None:
            async for out in stream:
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
            return ChatCompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=self.usage())
        choices = [CompletionChoice(
            index=i, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=None if self.k is None else completion_logprobs(c.token_ids, c.logprobs, self.k))
            for i, c in enumerate(self.choices)]
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=self.usage())

    async def stream(self, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        """SSE events: one per choice per engine step, then usage if asked, then `[DONE]`."""
        try:
            if self.chat:
                for i in range(len(self.choices)):
                    yield _event(ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
                        ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]))
            async for p, out in _merge(streams):
                for c in out.outputs:
                    i = p * self.n + c.index
                    state = self.choices[i]
                    if state.finish_reason is not None or (not c.token_ids and c.finish_reason is None):
                        continue
                    offset = len(state.text)
                    state.add(c)
                    if self.tools is not None:
                        for chunk in self._tool_chunks(i, c, state, offset):
                            yield _event(chunk)
                    else:
                        yield _event(self._chunk(i, c, offset))
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

    def _chunk(self, i: int, c, offset: int):
        if self.chat:
            lp = None if self.k is None else chat_logprobs(c.token_ids, c.logprobs or [], self.k)
            return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
                ChatStreamChoice(index=i, delta=DeltaMessage(content=c.text), logprobs=lp, finish_reason=c.finish_reason)])
        lp = None if self.k is None else completion_logprobs(c.token_ids, c.logprobs or [], self.k, offset)
        return CompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
            CompletionChoice(index=i, text=c.text, logprobs=lp, finish_reason=c.finish_reason)])


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


def _event(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
