"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` for every failure."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.engine_client import EngineError
from serving.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          429: "server_overloaded", 500: "internal_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    """An HTTP error with an OpenAI-style body; `retry_after` (seconds) becomes a Retry-After header."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.retry_after = retry_after

    @classmethod
    def from_engine(cls, e: EngineError) -> OpenAIError:
        return cls(e.status, e.message, e.type, retry_after=e.retry_after)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def sse(self) -> str:
        return f"data: {self.body().model_dump_json()}\n\n"

    def response(self) -> JSONResponse:
        headers = None if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def from_validation_error(e: ValidationError) -> OpenAIError:
    """The first problem pydantic found, phrased for a user, with the field path as `param`."""
    err = e.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    if err.get("type") == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {err.get('msg')}", code="invalid_json")
    if err.get("type") == "extra_forbidden":
        return OpenAIError(400, f"unrecognized request argument supplied: {loc}", param=loc, code="unknown_parameter")
    if err.get("type") == "missing":
        return OpenAIError(400, f"missing required parameter: {loc}", param=loc, code="missing_required_parameter")
    value = json.dumps(err.get("input"), default=str)
    if len(value) > 80:
        value = value[:77] + "..."
    message = f"invalid value for {loc or 'the request body'}: {err.get('msg')} (got {value})"
    return OpenAIError(400, message, param=loc or None, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        message = "not found" if e.status_code == 404 else str(e.detail)
        return OpenAIError(e.status_code, message).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return OpenAIError(400, f"invalid request: {e.errors()[0].get('msg')}").response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return OpenAIError(500, f"internal server error: {type(e).__name__}: {e}").response()
