"""OpenAI API request and response models (field names and shapes as in the OpenAI API).

Requests are strict about the fields they know: wrong types are refused rather than coerced. Unknown
fields are ignored (logged at debug level), as vLLM ignores them, so that clients written for other
servers work. Fields beyond OpenAI's (`top_k`, `ignore_eos`, `priority`, `min_tokens`, `min_p`,
`repetition_penalty`, `bad_words`, `prompt_logprobs`, the chat template options, `structured_outputs` and
the older `guided_*` fields, ...) follow vLLM, and clients send them through `extra_body`."""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from workers.sampling_params import (INT64_MAX, INT64_MIN, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                     MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS)

logger = logging.getLogger(__name__)
MAX_N = 128
MAX_STOP_SEQUENCES = 16

# Every number must be one the engine can hold (int64 at most, floats finite): out of range is a 400
# naming the field, never an error inside the engine.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt64 = Annotated[int, Field(ge=1, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,18}$")]  # JSON object keys are strings: "50256"
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]


def _as_list(value: Any) -> Any:
    """`stop` may be one string: make it a list, so that errors name `stop` or `stop.<index>`."""
    return [value] if isinstance(value, str) else value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data: Any, handler):
        if isinstance(data, dict) and (ignored := data.keys() - cls.model_fields.keys()):
            logger.debug("%s: ignored unknown field(s) %s", cls.__name__, sorted(ignored))
        return handler(data)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` request field (exactly one constraint; checked when it is used)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingFields(_Strict):
    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    seed: Int64 | None = None
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES), BeforeValidator(_as_list)] | None = None
    stop_token_ids: Annotated[list[NonNegativeInt64], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt64 = 0
    priority: Int64 = 0
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    logit_bias: Annotated[dict[TokenIdKey, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Logprobs | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt (and, with logprobs, its tokens' logprobs) starts each choice
    max_tokens: NonNegativeInt64 | None = 16  # 0 only with echo: score the prompt, generate nothing
    logprobs: Logprobs | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1 (0 is allowed only with echo)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("suffix is not supported by this server")
        return value


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[str | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class _ChatTemplateFields(_Strict):
    """vLLM's options for rendering `messages` with the chat template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(add_generation_prompt defaults to true: set it to false)")
        return value


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt64 | None = None
    max_completion_tokens: PositiveInt64 | None = None
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's `/tokenize`: a `prompt`, or chat `messages` with the chat template options."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[NonNegativeInt64]


# ---- responses --------------------------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Out):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Out):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # vLLM's: None first, then token id -> logprob


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Out):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Out):
    name: str
    arguments: str


class ToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(_Out):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(_Out):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Out):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvrelay"
    root: str | None = None
    max_model_len: int | None = None


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Out):
    prompt: str


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Out):
    error: ErrorInfo
