"""A request's output constraint, from whichever field set it: OpenAI's `response_format`, vLLM's
`structured_outputs`, the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
(removed in vLLM 0.12, still accepted here for older clients), or a tool choice that needs one. At most
one may be set; an invalid schema, regex or grammar is a 400 naming the field."""

from __future__ import annotations

from serving.errors import OpenAIError
from serving.tool_calls import ToolPlan
from workers.structured_output import validate_structured_outputs
from workers.structured_params import StructuredOutputsParams


def _from_fields(body) -> list[tuple[str, StructuredOutputsParams]]:
    """Every constraint the request sets, with the field that set it (as `param` of an error)."""
    found: list[tuple[str, dict]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        found.append(("response_format.json_schema.schema", {"json": schema if schema is not None else {}}))
    if body.structured_outputs is not None:
        so = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", so))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append((name, {key: value}))
    out = []
    for field, kwargs in found:
        try:
            out.append((field, StructuredOutputsParams(**kwargs)))
        except ValueError as e:
            raise OpenAIError(400, _rename(str(e), field), param=field) from None
    return out


def _rename(message: str, field: str) -> str:
    """Speak of the request's own field rather than the engine's `structured_outputs`."""
    if field == "structured_outputs":
        return message
    head, _, rest = message.partition(" ")
    return f"{field} {rest}" if head.startswith("structured_outputs") else f"{field}: {message}"


def structured_outputs_for(body, plan: ToolPlan | None = None) -> StructuredOutputsParams | None:
    """The one constraint of this request, validated; None when there is none."""
    found = _from_fields(body)
    if plan is not None and plan.schema is not None:
        found.append(("tools", StructuredOutputsParams(json=plan.schema)))
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise OpenAIError(400, f"set at most one output constraint; this request sets {names}", param=found[1][0])
    if not found:
        return None
    field, params = found[0]
    try:
        validate_structured_outputs(params)
    except ValueError as e:
        head = str(e).split(" ", 1)[0]
        param = head if field == "structured_outputs" and head.startswith("structured_outputs.") else field
        raise OpenAIError(400, _rename(str(e), field), param=param) from None
    return params
