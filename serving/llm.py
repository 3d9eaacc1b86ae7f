"""Offline generation in the manner of vLLM's `LLM`: submit everything, step the engine until done,
return outputs in input order."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from serving.chat import ChatTemplateOptions, chat_prompt_ids, load_chat_template
from workers.config import EngineConfig
from workers.engine import Engine
from workers.output_processor import OutputKind
from workers.outputs import RequestOutput
from workers.sampling_params import SamplingParams

Prompt = str | list[int]
Conversation = list[dict[str, Any]]


class LLM:
    """`LLM(model=None, **engine_options)`, `model=None` being the default SmolLM2-135M-Instruct, or
    `LLM(config=EngineConfig(...))` with the options already parsed."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **engine_options) -> None:
        if config is not None and (model is not None or engine_options):
            raise ValueError("pass either config=EngineConfig(...) or model and engine options, not both")
        self.engine = Engine(config or EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or many (strings or token-id lists); one `SamplingParams` for all or
        one per prompt. All prompts are validated before any is queued."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        for p in prompts:
            self.engine.validate_prompt(p, None)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, sp, prio in zip(ids, prompts, params, priorities):
                self.engine.add_request(rid, prompt, sp, priority=prio, output_kind=OutputKind.FINAL_ONLY)
                added.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(added)
            raise

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        if use_tqdm is None:
            use_tqdm = len(ids) >= 32 and sys.stderr.isatty()
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                failed = [rid for rid in ids if rid in self.engine.failed]
                if failed:
                    raise RuntimeError(f"prompt {ids.index(failed[0])} of this batch failed: "
                                       f"{self.engine.failed[failed[0]]}; the other prompts were aborted")
                if len(results) < len(ids) and not self.engine.has_unfinished_requests():
                    missing = [i for i, rid in enumerate(ids) if rid not in results]
                    raise RuntimeError(f"the engine ended prompts {missing[:5]} without output")
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True, *, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or many, formatted by the chat template (the tokenizer's,
        or `chat_template`: the template itself or a file's path), with vLLM's template options."""
        if not messages:
            raise ValueError("messages must not be empty")
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, continue_final_message=continue_final_message,
                                            chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                            tools=tools) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            chat_template_kwargs: Mapping[str, Any] | None = None,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The prompt token ids `chat` generates from. Raises ValueError (a `ChatInputError` naming the field)
        for a malformed message or option."""
        options = ChatTemplateOptions(add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      chat_template=load_chat_template(chat_template),
                                      chat_template_kwargs=dict(chat_template_kwargs or {}), tools=tools)
        return chat_prompt_ids(self.tokenizer, conversation, options)
