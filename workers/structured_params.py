"""What a request's output must follow (vLLM's `StructuredOutputsParams`): a JSON schema, any JSON object,
a regex, one of several strings, or an EBNF grammar, exactly one of them.

Only shapes and types are checked here (this module imports nothing heavy, so every layer may use it);
whether the schema, regex or grammar itself is valid is checked by `workers.structured_output`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_CHOICES = 1024

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Set exactly one of `json` (a JSON schema, as a dict or a JSON string), `regex`, `choice` (the
    output is exactly one of these strings), `grammar` (xgrammar's EBNF, `root ::= ...`) or
    `json_object=True` (any JSON object). `disable_any_whitespace`: JSON output uses no whitespace
    beyond single spaces after separators (vLLM's option of the same name)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the field unless exactly one constraint is set and it has the right type."""
        chosen = [k for k in KINDS if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar or json_object; "
                             f"got {', '.join(chosen) if chosen else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(parsed).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or "\x00" in value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string without NUL characters")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true when set, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: the kind, the spec in a canonical text, the whitespace option."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            value = json.dumps(json.loads(value) if isinstance(value, str) else value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value, self.disable_any_whitespace
