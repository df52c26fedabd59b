"""``GET /openapi.json``: every route the app serves, with its request and reply
bodies generated from the pydantic models.

Clients and API fuzzers (tests/test_server_hostile.py) read the same schema
the server validates with, so the two cannot drift apart; a test checks that
every route of the app is in the document.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from turbospark.server.anthropic import CountTokensRequest, MessagesRequest
from turbospark.server.embeddings import EmbeddingList, EmbeddingRequest
from turbospark.server.responses import ResponsesRequest
from turbospark.server.schemas import (
    AnthropicErrorBody,
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
    TextCompletion,
)
from turbospark.server.sessions import SessionsView

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "a malformed request (the error names the parameter)",
    "401": "an API key is needed (--api-key) and none or another was sent",
    "404": "an unknown model or route",
    "408": "the body was not sent within --request-timeout",
    "413": "the body is larger than --max-request-bytes",
    "503": "the queue is full (--max-queue); see Retry-After",
    "504": "the request ran past --request-timeout",
}
_OBJECT = {"type": "object"}
_STREAM = {"text/event-stream": {"schema": {"type": "string"}}}


def _json(ref: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": ref}}


def _post(
    request: dict[str, Any],
    reply: dict[str, Any],
    error: dict[str, Any],
    what: str,
    streams: bool = True,
) -> dict[str, Any]:
    content = {**_json(reply), **(_STREAM if streams else {})}
    responses = {"200": {"description": what, "content": content}}
    responses |= {
        code: {"description": why, "content": _json(error)} for code, why in _ERRORS.items()
    }
    return {
        "post": {
            "requestBody": {"required": True, "content": _json(request)},
            "responses": responses,
        }
    }


def _get(what: str, media: str | None = None, schema: dict[str, Any] | None = None) -> dict:
    ok: dict[str, Any] = {"description": what}
    if media is not None:
        ok["content"] = {media: {"schema": schema or {"type": "string"}}}
    return {"get": {"responses": {"200": ok}}}


def openapi_document() -> dict[str, Any]:
    """An OpenAPI 3.1 document: requests in their validation form, replies as serialised."""
    models: list[tuple[type[BaseModel], str]] = [
        (ChatCompletionRequest, "validation"),
        (CompletionRequest, "validation"),
        (MessagesRequest, "validation"),
        (CountTokensRequest, "validation"),
        (ResponsesRequest, "validation"),
        (EmbeddingRequest, "validation"),
        (ChatCompletion, "serialization"),
        (TextCompletion, "serialization"),
        (EmbeddingList, "serialization"),
        (ModelList, "serialization"),
        (ModelCard, "serialization"),
        (ErrorBody, "serialization"),
        (AnthropicErrorBody, "serialization"),
        (SessionsView, "serialization"),
    ]
    refs, schema = models_json_schema(models, ref_template=_REF)
    ref = {model: refs[(model, mode)] for model, mode in models}
    error, anthropic_error = ref[ErrorBody], ref[AnthropicErrorBody]
    model_card = _get("the model, when it is the one served", "application/json", ref[ModelCard])
    model_card["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    model_card["get"]["responses"]["404"] = {
        "description": "another model",
        "content": _json(error),
    }
    count = {"type": "object", "properties": {"input_tokens": {"type": "integer"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "turbospark", "version": "1"},
        "paths": {
            "/v1/chat/completions": _post(
                ref[ChatCompletionRequest],
                ref[ChatCompletion],
                error,
                "the completion, or with stream=true a text/event-stream of chunks",
            ),
            "/v1/completions": _post(
                ref[CompletionRequest],
                ref[TextCompletion],
                error,
                "the completion, or with stream=true a text/event-stream of chunks",
            ),
            "/v1/responses": _post(
                ref[ResponsesRequest],
                _OBJECT,
                error,
                "an OpenAI Responses object, or with stream=true its SSE events",
            ),
            "/v1/messages": _post(
                ref[MessagesRequest],
                _OBJECT,
                anthropic_error,
                "an Anthropic message, or with stream=true its SSE events (errors in "
                "Anthropic's shape)",
            ),
            "/v1/messages/count_tokens": _post(
                ref[CountTokensRequest],
                count,
                anthropic_error,
                "the prompt's token count as the template renders it",
                streams=False,
            ),
            "/v1/embeddings": _post(
                ref[EmbeddingRequest],
                ref[EmbeddingList],
                error,
                "each input's mean-pooled, L2-normalized final hidden states",
                streams=False,
            ),
            "/v1/models": _get("the served model", "application/json", ref[ModelList]),
            "/v1/models/{model}": model_card,
            "/health": _get("the server is up (never needs the API key)", "application/json"),
            # What SGLang's model gateway reads from a worker (turbospark.server.gateway).
            **{
                path: _get(what, "application/json", _OBJECT)
                for paths, what in [
                    (("/get_server_info", "/server_info"), "the worker's batch and context sizes"),
                    (
                        ("/get_model_info", "/model_info"),
                        "the served model: context, vocabulary, eos ids",
                    ),
                ]
                for path in paths
            },
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/openapi.json": _get("this document", "application/json", _OBJECT),
            "/": _get("the page: chat and the sessions view", "text/html"),
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
