"""``GET /openapi.json``: the API's request and response bodies, from the pydantic models.

Clients and API fuzzers (tests/test_server_hostile.py) read the same schema
the server validates with, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from turbospark.server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ModelList,
    TextCompletion,
)
from turbospark.server.sessions import SessionsView

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "a malformed request (the error names the parameter)",
    "404": "an unknown model or route",
    "408": "the body was not sent within --request-timeout",
    "413": "the body is larger than --max-request-bytes",
    "503": "the queue is full (--max-queue); see Retry-After",
    "504": "the request ran past --request-timeout",
}


def _json(ref: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": ref}}


def _post(request: dict[str, Any], reply: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    responses = {
        "200": {
            "description": "the completion, or with stream=true a text/event-stream of chunks",
            "content": {**_json(reply), "text/event-stream": {"schema": {"type": "string"}}},
        }
    }
    responses |= {
        code: {"description": why, "content": _json(error)} for code, why in _ERRORS.items()
    }
    return {
        "post": {
            "requestBody": {"required": True, "content": _json(request)},
            "responses": responses,
        }
    }


def openapi_document() -> dict[str, Any]:
    """An OpenAPI 3.1 document: requests in their validation form, replies as serialised."""
    models: list[tuple[type[BaseModel], str]] = [
        (ChatCompletionRequest, "validation"),
        (CompletionRequest, "validation"),
        (ChatCompletion, "serialization"),
        (TextCompletion, "serialization"),
        (ModelList, "serialization"),
        (ErrorBody, "serialization"),
        (SessionsView, "serialization"),
    ]
    refs, schema = models_json_schema(models, ref_template=_REF)
    ref = {model: refs[(model, mode)] for model, mode in models}
    error = ref[ErrorBody]
    return {
        "openapi": "3.1.0",
        "info": {"title": "turbospark", "version": "1"},
        "paths": {
            "/v1/chat/completions": _post(ref[ChatCompletionRequest], ref[ChatCompletion], error),
            "/v1/completions": _post(ref[CompletionRequest], ref[TextCompletion], error),
            "/v1/models": {
                "get": {
                    "responses": {
                        "200": {"description": "the served model", "content": _json(ref[ModelList])}
                    }
                }
            },
            "/health": {"get": {"responses": {"200": {"description": "the server is up"}}}},
            "/turbospark/sessions": {
                "get": {
                    "responses": {
                        "200": {
                            "description": "every warm session: counts, sizes and reasons, "
                            "never token ids or text",
                            "content": _json(ref[SessionsView]),
                        },
                        "503": {
                            "description": "the engine is busy warming up",
                            "content": _json(error),
                        },
                    }
                }
            },
        },
        "components": {"schemas": schema.get("$defs", {})},
    }
