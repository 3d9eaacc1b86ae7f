"""Chat messages to prompt token ids the way vLLM builds them: each message flattened for the chat
template (text parts joined by newlines; `name`, tool calls, tool results and reasoning kept), rendered
with the request's template options, then tokenized."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Content part types that carry text, and the key that holds it (vLLM's text-like parts).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
# chat_template_kwargs that would clash with how the prompt is rendered (vLLM refuses the same two).
RESERVED_TEMPLATE_KWARGS = ("chat_template", "tokenize")


class ChatInputError(ValueError):
    """A message or template option the server cannot use; `param` names the field
    (`messages.0.content.1.type`), as an HTTP 400 does."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """How a conversation is rendered (vLLM's request fields of the same names). `chat_template` is the
    template itself; None uses the tokenizer's."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tools: Sequence[Mapping[str, Any]] | None = None
    documents: Sequence[Mapping[str, Any]] | None = None
    add_special_tokens: bool = False


def load_chat_template(value: str | None) -> str | None:
    """A chat template given as a file's path or as the template itself (vLLM's `--chat-template`)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat template {value!r} looks like a file path, but there is no such file; pass a "
                     "readable Jinja file or the template text itself")


def text_content(content: Any, where: str) -> str:
    """A message's content as one string: a string as is, None as "", a list of parts as its text parts
    joined by newlines. Any other part (an image, audio, a file) is refused: this is a text-only server."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ChatInputError(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatInputError(f"{at} must be a content part object such as {{\"type\": \"text\", \"text\": ...}}", at)
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            what = f"content parts of type {kind!r} are not supported" if isinstance(kind, str) else "missing or invalid type"
            raise ChatInputError(f"{at}.type: {what}; this server serves a text-only model and takes "
                                 f"{', '.join(TEXT_PARTS)} parts", f"{at}.type")
        text = part.get(TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise ChatInputError(f"{at}.{TEXT_PARTS[kind]} must be a string", f"{at}.{TEXT_PARTS[kind]}")
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Tool calls as chat templates expect them: `function.arguments` a dict, parsed from the JSON string
    OpenAI clients send ({} when it is not JSON, as vLLM does)."""
    if not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls):
        raise ChatInputError(f"{where} must be a list of tool call objects", where)
    out = copy.deepcopy([dict(c) for c in calls])
    for call in out:
        function = call.get("function")
        if not isinstance(function, dict):
            continue
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                function["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                function["arguments"] = {}
        elif not isinstance(args, (dict, list)):
            function["arguments"] = {}
    return out


def conversation_for_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template sees them. Keys other than these are dropped: role, content,
    name, assistant `tool_calls` and `reasoning`, tool `tool_call_id`."""
    if not messages:
        raise ChatInputError("messages must not be empty", "messages")
    conversation = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatInputError(f"{where} must be an object with a string 'role'", f"{where}.role")
        out: dict[str, Any] = {"role": m["role"], "content": text_content(m.get("content"), f"{where}.content")}
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        if m["role"] == "assistant":
            if m.get("tool_calls"):
                out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            if isinstance(m.get("reasoning"), str):
                out["reasoning"] = out["reasoning_content"] = m["reasoning"]
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            out["tool_call_id"] = m["tool_call_id"]
        conversation.append(out)
    return conversation


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], options: ChatTemplateOptions) -> str:
    """The prompt text of `messages` under `options`. Raises ChatInputError naming the field at fault."""
    if options.add_generation_prompt and options.continue_final_message:
        raise ChatInputError("continue_final_message and add_generation_prompt cannot both be true: continue the "
                             "final (assistant) message, or start a new one", "continue_final_message")
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in options.chat_template_kwargs:
            raise ChatInputError(f"chat_template_kwargs may not set {key!r}"
                                 + ("; pass chat_template as its own field" if key == "chat_template" else ""),
                                 f"chat_template_kwargs.{key}")
    conversation = conversation_for_template(messages)
    template = options.chat_template or tokenizer.chat_template
    if template is None:
        raise ChatInputError("this model's tokenizer has no chat template; pass one (chat_template, or the "
                             "server's --chat-template)", "messages")
    kwargs: dict[str, Any] = {"add_generation_prompt": options.add_generation_prompt,
                              "continue_final_message": options.continue_final_message,
                              "tools": None if options.tools is None else [dict(t) for t in options.tools],
                              "documents": None if options.documents is None else [dict(d) for d in options.documents]}
    kwargs.update(options.chat_template_kwargs)
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
    except Exception as e:  # the template is user code: any error in it is the request's
        raise ChatInputError(f"cannot apply the chat template: {type(e).__name__}: {e}",
                             "chat_template" if options.chat_template else "messages") from None


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                    options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
    """Token ids of `messages` rendered by the chat template (special tokens only as the template writes
    them, unless `options.add_special_tokens`)."""
    text = render_chat(tokenizer, messages, options)
    return list(tokenizer(text, add_special_tokens=options.add_special_tokens).input_ids)
