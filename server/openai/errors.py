"""Errors of the OpenAI-compatible API in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, and how the server's exceptions map to
them: a `ValidationError` (the checks the gRPC API makes, its message naming the OpenAI field)
is 400, `Overloaded` (MAX_CONCURRENT_REQUESTS) 429, a `GenerationError` 500. No response
carries a traceback."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pydantic
from starlette.responses import JSONResponse

from server.errors import GenerationError, Overloaded, ResponseTooLarge
from server.messages import ValidationError, clip
from server.status import MAX_ERROR_MESSAGE_BYTES

logger = logging.getLogger(__name__)

INVALID = "invalid_request_error"


@dataclass
class ApiError(Exception):
    """One error response. `err` is its `tgi_request_failure` cause (None: not counted there,
    it was not a generation request)."""

    status: int
    message: str
    type: str = INVALID
    param: str | None = None
    code: str | None = None
    err: str | None = "validation"

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": clip(self.message, MAX_ERROR_MESSAGE_BYTES),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


_TGIS_FIELDS = (
    ("max_new_tokens", "max_tokens"),
    ("min_new_tokens", "min_tokens"),
    ("top_n_tokens", "top_logprobs"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("typical_p", "typical_p"),
    ("top_k", "top_k"),
    ("repetition_penalty", "repetition_penalty"),
    ("can specify at most", "stop"),
)
"""TGIS field names at the start of a validation message -> the OpenAI field."""
_INPUT_MESSAGES = ("input tokens", "input text is", "tokenizer error")


def from_validation(e: ValidationError, prompt_param: str, top_param: str) -> ApiError:
    """A gRPC-side validation failure as a 400 naming the OpenAI field: `prompt_param` for the
    input's checks (prompt or messages), `top_param` for the top-token bound (logprobs or
    top_logprobs). The TGIS field name that starts the message is replaced by OpenAI's."""
    message = e.message
    if message.startswith(_INPUT_MESSAGES):
        return bad_request(message, prompt_param)
    for tgis, openai in _TGIS_FIELDS:
        if message.startswith(tgis):
            param = top_param if openai == "top_logprobs" else openai
            if tgis != "can specify at most":
                message = param + message[len(tgis) :]
            return bad_request(message, param)
    return bad_request(message)


def from_pydantic(e: pydantic.ValidationError) -> ApiError:
    """A body that is not valid JSON, or not the request's schema: 400 naming the first
    field at fault."""
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first['msg']}")
    loc = [str(part) for part in first["loc"] if not str(part).startswith(("list[", "str"))]
    loc = [part for part in loc if part not in ("int", "float", "bool", "TextPart")]
    param = ".".join(loc) or None
    if first["type"] == "model_type" and not loc:
        return bad_request("the body must be a JSON object")
    where = f"'{param}': " if param else ""
    return bad_request(f"{where}{first['msg']}", param)


def from_exception(e: Exception, prompt_param: str, top_param: str) -> ApiError:
    """The response for an exception a generation request raised."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ValidationError):
        return from_validation(e, prompt_param, top_param)
    if isinstance(e, Overloaded):
        return ApiError(429, str(e), "rate_limit_error", code="overloaded", err="conc_limit")
    if isinstance(e, ResponseTooLarge):
        return ApiError(400, str(e))
    if isinstance(e, GenerationError):
        message = f"Request failed during generation: {e}"
        return ApiError(500, message, "server_error", err="generate")
    logger.error("request failed", exc_info=e)
    return ApiError(500, "internal error", "server_error", err="unknown")
