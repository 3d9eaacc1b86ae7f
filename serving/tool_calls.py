"""OpenAI tool calling, as vLLM does it: `tool_choice` "required" or a named function constrains the output
with a JSON schema over the tools' parameters; "auto" lets the model choose and a parser (Hermes-style
`<tool_call>{json}</tool_call>`) finds the calls in its text; "none" is plain text."""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from serving.errors import OpenAIError
from serving.protocol import ChatCompletionRequest, ChatTool, FunctionCall, NamedToolChoice, ToolCall

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_START = "<tool_call>"


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(slots=True)
class ToolPlan:
    """How one chat request uses its tools: the mode, the named function, the JSON schema that
    constrains the output (required / named), and the tools to hand to the chat template."""

    mode: ToolMode = ToolMode.NONE
    name: str | None = None
    schema: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)

    @property
    def calls_tools(self) -> bool:
        return self.mode is not ToolMode.NONE


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _required_schema(tools: list[ChatTool]) -> dict[str, Any]:
    """A non-empty JSON array of `{"name": <one tool's name>, "parameters": <its parameters>}` (vLLM's
    schema for tool_choice "required"); `$defs` of all tools are gathered at the top."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = dict(_parameters(tool))
        for name, schema in params.pop("$defs", {}).items():
            if defs.get(name, schema) != schema:
                raise OpenAIError(400, f"tools define $defs {name!r} twice, differently", param="tools")
            defs[name] = schema
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


def tool_plan(body: ChatCompletionRequest, enable_auto_tool_choice: bool, parser: str | None) -> ToolPlan:
    """The request's `ToolPlan`; OpenAIError 400 for a choice that cannot be served (vLLM's rules)."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise OpenAIError(400, "tool_choice needs tools: set tools, or drop tool_choice", param="tool_choice")
    if not tools:
        return ToolPlan()
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan(ToolMode.NONE, tools=rendered)
    if isinstance(choice, NamedToolChoice):
        match = next((t for t in tools if t.function.name == choice.function.name), None)
        if match is None:
            raise OpenAIError(400, f"tool_choice names {choice.function.name!r}, which is not among tools",
                              param="tool_choice")
        return ToolPlan(ToolMode.NAMED, match.function.name, _parameters(match), rendered)
    if choice == "required":
        return ToolPlan(ToolMode.REQUIRED, schema=_required_schema(tools), tools=rendered)
    if not (enable_auto_tool_choice and parser):
        raise OpenAIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                               "set on the server (or send tool_choice \"none\", \"required\" or a named function)",
                          param="tool_choice")
    return ToolPlan(ToolMode.AUTO, tools=rendered)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: Any) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=args))


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """The message content and tool calls in a finished output. Output that does not parse (cut short by
    max_tokens) stays content, with no calls."""
    if plan.mode is ToolMode.NAMED:
        return "", [_call(plan.name, text)]
    if plan.mode is ToolMode.REQUIRED:
        try:
            calls = json.loads(text)
            return "", [_call(c["name"], c.get("parameters", {})) for c in calls]
        except (ValueError, TypeError, KeyError):
            return text, []
    if plan.mode is ToolMode.AUTO and HERMES_START in text:
        calls = []
        for raw in _HERMES.findall(text):
            try:
                item = json.loads(raw)
                calls.append(_call(item["name"], item.get("arguments", {})))
            except (ValueError, TypeError, KeyError):
                return text, []
        content = text[:text.index(HERMES_START)].strip()
        return content or None, calls
    return text, []


def finish_reason(plan: ToolPlan, calls: list[ToolCall], reason: str | None) -> str | None:
    """vLLM's (and OpenAI's) finish reason: "tool_calls" when "auto" called tools or "required" ended
    normally; a named call keeps "stop"."""
    if reason == "stop" and calls and plan.mode in (ToolMode.AUTO, ToolMode.REQUIRED):
        return "tool_calls"
    return reason
