"""Refusals: :class:`APIError`, its JSON rendering, and the app's handlers.

Every refusal is ``{"error": {message, type, param, code}}`` with a 4xx status
(5xx only for the server's own limits and faults), except on Anthropic's routes
(``/v1/messages...``), where it takes Anthropic's shape, ``{"type": "error",
"error": {type, message}}``, whoever refuses: a handler, the API-key check, a
wrong method, a fault. The SDKs pick their exception class (e.g.
``anthropic.AuthenticationError``) from that shape. Error bodies are rendered
with ``ensure_ascii=True``: a message may quote what the client sent, and a
lone UTF-16 surrogate in it must not turn a 400 into a 500 while encoding.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from turbospark.errors import ContextOverflow, InvalidInput, TurbosparkError
from turbospark.server.schemas import (
    AnthropicErrorBody,
    AnthropicErrorDetail,
    ErrorBody,
    ErrorDetail,
)


class APIError(Exception):
    """A refusal with its HTTP status, OpenAI error fields and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.body = ErrorBody(
            error=ErrorDetail(
                message=message,
                type="invalid_request_error" if status < 500 else "server_error",
                param=param,
                code=code,
            )
        )


ANTHROPIC_ROUTES = "/v1/messages"  # the Messages API and count_tokens below it

# Anthropic's error types by status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_json(body: ErrorBody | dict[str, Any]) -> str:
    """The body as ASCII JSON, whatever characters the message quotes."""
    data = body.model_dump() if isinstance(body, ErrorBody) else body
    return json.dumps(data, ensure_ascii=True)


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """The refusal in Anthropic's shape: ``{"type": "error", "error": {type, message}}``."""
    fallback = "invalid_request_error" if error.status < 500 else "api_error"
    kind = _ANTHROPIC_TYPES.get(error.status, fallback)
    detail = AnthropicErrorDetail(type=kind, message=error.body.error.message)
    return AnthropicErrorBody(error=detail).model_dump()


def error_response(error: APIError, path: str = "") -> Response:
    """The refusal as the route's API shapes it (Anthropic's under ``/v1/messages``)."""
    anthropic = path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/")
    return Response(
        error_json(anthropic_error_body(error) if anthropic else error.body),
        status_code=error.status,
        headers=error.headers,
        media_type="application/json",
    )


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple[int | str, ...]) -> str:
    """``messages.0.content``: pydantic's location without its union-member tags
    (``function-after[...]``, ``str``, ``list[int]``), which name no parameter."""
    return ".".join(
        str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)
    )


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic failure as a 400 naming the bad parameter (all failures are
    listed). Of a union's failures the deepest names it: ``content`` failed as
    a string *and* at ``content.0.text`` as a list of parts; the latter says where."""
    errors = exc.errors()
    first = max(errors, key=lambda e: len(_param(e["loc"]).split(".")))
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    lines = dict.fromkeys(f"{_param(e['loc']) or 'body'}: {e['msg']}" for e in errors)
    return APIError(400, "; ".join(lines), param=_param(first["loc"]) or None, code=code)


def refusal(exc: TurbosparkError, param: str) -> APIError:
    if isinstance(exc, ContextOverflow):
        return APIError(400, str(exc), param=param, code="context_length_exceeded")
    if isinstance(exc, InvalidInput):
        return APIError(400, str(exc), param=param, code="invalid_value")
    return APIError(500, str(exc))


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc, request.url.path)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(
        APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"),
        request.url.path,
    )


async def server_error(request: Request, exc: Exception) -> Response:
    return error_response(
        APIError(500, f"internal error: {type(exc).__name__}: {exc}"), request.url.path
    )


class ClientGone(Exception):
    """The client of a non-streaming request hung up; nothing is sent back."""


async def client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody is listening: nginx's "client closed request"


HANDLERS = {
    APIError: api_error,
    HTTPException: http_error,
    ClientGone: client_gone,
    Exception: server_error,
}
