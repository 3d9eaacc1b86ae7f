"""Tool choice and output constraints on the server side, without a server: which choices are served,
the JSON schema that "required" uses, parsing calls out of finished text (Hermes for "auto"), and the
400s that name the request field with a bad schema or two constraints."""

from __future__ import annotations

import json

import jsonschema
import pytest

from serving.errors import OpenAIError
from serving.protocol import ChatCompletionRequest, CompletionRequest
from serving.structured_outputs import structured_outputs_for
from serving.tool_calls import ToolMode, finish_reason, parse_tool_calls, tool_plan

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_tool_choice_modes():
    assert tool_plan(chat(), False, None).mode is ToolMode.NONE
    assert tool_plan(chat(tools=[WEATHER], tool_choice="none"), False, None).tools  # the template still sees them
    named = tool_plan(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                      False, None)
    assert (named.mode, named.name, named.schema) == (ToolMode.NAMED, "get_time", {"type": "object", "properties": {}})
    assert tool_plan(chat(tools=[WEATHER]), True, "hermes").mode is ToolMode.AUTO  # tools without a choice: auto


@pytest.mark.parametrize("fields, enabled, match", [
    ({"tools": [WEATHER]}, False, "--enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, False, "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, True, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, True, "'nope'"),
])
def test_unservable_tool_choices_are_400(fields, enabled, match):
    with pytest.raises(OpenAIError, match=match) as e:
        tool_plan(chat(**fields), enabled, "hermes" if enabled else None)
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_required_schema_accepts_calls_of_listed_tools_only():
    plan = tool_plan(chat(tools=[WEATHER, TIME], tool_choice="required"), False, None)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, plan.schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, plan.schema)
    content, calls = parse_tool_calls(plan, json.dumps(ok))
    assert content == "" and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)
    assert finish_reason(plan, calls, "stop") == "tool_calls"
    assert finish_reason(plan, [], "length") == "length"
    assert parse_tool_calls(plan, '[{"name": "get_we') == ('[{"name": "get_we', [])  # cut short: content


def test_named_call_keeps_stop_and_raw_arguments():
    plan = tool_plan(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                     False, None)
    content, calls = parse_tool_calls(plan, '{"city": "Oslo"}')
    assert calls[0].function.arguments == '{"city": "Oslo"}' and calls[0].function.name == "get_weather"
    assert finish_reason(plan, calls, "stop") == "stop"


def test_hermes_parser_splits_content_and_calls():
    plan = tool_plan(chat(tools=[WEATHER]), True, "hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Nice"}}</tool_call>')
    content, calls = parse_tool_calls(plan, text)
    assert content == "Let me check."
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Rome", "Nice"]
    assert finish_reason(plan, calls, "stop") == "tool_calls"
    assert parse_tool_calls(plan, "No tools needed.") == ("No tools needed.", [])
    assert parse_tool_calls(plan, "<tool_call>{broken") == ("<tool_call>{broken", [])


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}}, "json"),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "a+"}}, "regex"),
    ({"guided_json": {"type": "object"}}, "json"),
    ({"guided_regex": "a+"}, "regex"),
    ({"guided_choice": ["a", "b"]}, "choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar"),
])
def test_every_constraint_field_maps_to_structured_outputs(fields, kind):
    so = structured_outputs_for(CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}))
    assert (so.kind if so else None) == kind


@pytest.mark.parametrize("fields, param, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema is not a valid JSON schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "guided_regex is not a valid regex"),
    ({"guided_choice": []}, "guided_choice", "guided_choice must be a list"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar", "not a valid EBNF"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "at most one"),
])
def test_bad_constraints_are_400_naming_the_field(fields, param, match):
    with pytest.raises(OpenAIError, match=match) as e:
        structured_outputs_for(CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields}))
    assert e.value.status == 400 and e.value.param == param


def test_tool_schema_counts_as_a_constraint():
    body = chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(OpenAIError, match="at most one"):
        structured_outputs_for(body, tool_plan(body, False, None))
    body = chat(tools=[WEATHER], tool_choice="required")
    assert structured_outputs_for(body, tool_plan(body, False, None)).kind == "json"
