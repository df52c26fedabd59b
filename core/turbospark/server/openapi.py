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
from turbospark.server.ollama import ChatBody, EmbedBody, GenerateBody, LegacyEmbedBody, ShowBody
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
        (ChatBody, "validation"),
        (GenerateBody, "validation"),
        (EmbedBody, "validation"),
        (LegacyEmbedBody, "validation"),
        (ShowBody, "validation"),
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
    stored = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    gone = {"description": "not stored, deleted or evicted (the error says which)",
            "content": _json(error)}  # fmt: skip
    ollama_error = {"type": "object", "properties": {"error": {"type": "string"}}}
    ndjson = {"application/x-ndjson": {"schema": {"type": "string"}}}

    def ollama_post(body: type[BaseModel], what: str, streams: bool = True) -> dict[str, Any]:
        path = _post(ref[body], _OBJECT, ollama_error, what, streams=False)
        if streams:
            path["post"]["responses"]["200"]["content"] |= ndjson
        return path

    def stored_route(method: str, what: str) -> dict[str, Any]:
        ok = {"description": what, "content": _json(_OBJECT)}
        return {method: {"parameters": [stored], "responses": {"200": ok, "404": gone}}}

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
            "/v1/responses/{response_id}": stored_route("get", "the stored response")
            | stored_route("delete", "the response was forgotten"),
            "/v1/responses/{response_id}/input_items": stored_route(
                "get", "the stored conversation before the response's output (order, limit, after)"
            ),
            "/api/chat": ollama_post(
                ChatBody, "Ollama's chat reply, streamed as NDJSON by default"
            ),
            "/api/generate": ollama_post(
                GenerateBody, "Ollama's generate reply, streamed as NDJSON by default"
            ),
            "/api/embed": ollama_post(EmbedBody, "Ollama's embeddings", streams=False),
            "/api/embeddings": ollama_post(
                LegacyEmbedBody, "Ollama's legacy single embedding", streams=False
            ),
            "/api/show": ollama_post(ShowBody, "the served model's details", streams=False),
            "/api/tags": _get(
                "the served model, as Ollama lists models", "application/json", _OBJECT
            ),
            "/api/ps": _get("the served model, always loaded", "application/json", _OBJECT),
            "/api/version": _get("the Ollama API version followed", "application/json", _OBJECT),
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
