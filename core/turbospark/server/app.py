"""The OpenAI-compatible HTTP API over one runner.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE
streaming), ``GET /v1/models``, ``GET /health``. There are no conversation ids:
the runner picks the session by token content (SEMANTICS.md), so any OpenAI
client gets prefix reuse by simply resending its conversation.

Every refusal is an OpenAI-style error body ``{"error": {message, type, param,
code}}`` with a 4xx status, decided *before* the request reaches the runner,
so a bad request never touches a session and the server keeps serving.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import mlx.core as mx
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from turbospark.errors import ContextOverflow, InvalidInput, TurbosparkError
from turbospark.generate import (
    Chunk,
    Completion,
    GenerationConfig,
    check_prompt,
    encode_prompt,
    generate,
    stream_generate,
)
from turbospark.runner import Runner
from turbospark.server.schemas import (
    AssistantMessage,
    BaseRequest,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    Delta,
    ErrorBody,
    ErrorDetail,
    Message,
    ModelCard,
    ModelList,
    TextChoice,
    TextCompletion,
    Usage,
    new_id,
)
from turbospark.server.worker import RunnerWorker
from turbospark.text import TextCodec

R = TypeVar("R", bound=BaseRequest)


class APIError(Exception):
    """A refusal with its HTTP status and OpenAI error fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(
            error=ErrorDetail(
                message=message,
                type="invalid_request_error" if status < 500 else "server_error",
                param=param,
                code=code,
            )
        )


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body.model_dump(), status_code=error.status)


def _validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    message = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
    )
    return APIError(400, message, param=param, code=code)


def _refusal(exc: TurbosparkError, param: str) -> APIError:
    if isinstance(exc, ContextOverflow):
        return APIError(400, str(exc), param=param, code="context_length_exceeded")
    if isinstance(exc, InvalidInput):
        return APIError(400, str(exc), param=param, code="invalid_value")
    return APIError(500, str(exc))


class Service:
    """One runner, its text codec, and the worker thread that owns them."""

    def __init__(
        self,
        runner: Runner,
        codec: TextCodec,
        *,
        model_id: str,
        chunk_size: int,
        default_max_tokens: int | None,
        worker: RunnerWorker,
    ) -> None:
        self.runner = runner
        self.codec = codec
        self.model_id = model_id
        self.chunk_size = chunk_size
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.worker = worker

    async def parse(self, request: Request, model: type[R]) -> R:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(
                400, f"the request body is not valid JSON: {exc}", code="invalid_json"
            ) from exc
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from exc
        if parsed.model != self.model_id:
            raise APIError(
                404,
                f"the model '{parsed.model}' does not exist; this server serves "
                f"'{self.model_id}' (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return parsed

    def chat_ids(self, messages: list[Message]) -> list[int]:
        return self._checked(
            lambda: self.codec.encode_chat([m.template_dict() for m in messages]), "messages"
        )

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        return self._checked(lambda: encode_prompt(self.codec, prompt), "prompt")

    def _checked(self, encode: Callable[[], list[int]], param: str) -> list[int]:
        """Encode and validate a prompt, refusing it as a 4xx before the runner sees it."""
        try:
            ids = encode()
            check_prompt(self.runner, ids)
        except TurbosparkError as exc:
            raise _refusal(exc, param) from exc
        return ids

    async def complete(self, ids: list[int], config: GenerationConfig) -> Completion:
        def work() -> Completion:
            try:
                return generate(self.runner, self.codec, ids, config)
            finally:
                self.runner.flush()  # write-through: a reply sent is a session on disk

        return await self.worker.call(work)

    def chunks(self, ids: list[int], config: GenerationConfig) -> AsyncIterator[Chunk]:
        def work() -> Iterator[Chunk]:
            try:
                yield from stream_generate(self.runner, self.codec, ids, config)
            finally:
                self.runner.flush()  # before [DONE] goes out (and after a hang-up)

        return self.worker.stream(work)


def _sse(payload: BaseModel | dict[str, Any] | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_none=False)
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


async def _sse_stream(
    chunks: AsyncIterator[Chunk],
    render: Callable[[Chunk], BaseModel | None],
    usage_event: Callable[[Usage], BaseModel] | None,
    param: str,
) -> AsyncIterator[str]:
    """SSE events for a stream of chunks; an error after the headers went out
    can only be reported in-band, as an ``error`` event."""
    try:
        async for chunk in chunks:
            event = render(chunk)
            if event is not None:
                yield _sse(event)
            if chunk.stats is not None and usage_event is not None:
                yield _sse(usage_event(Usage.from_stats(chunk.stats)))
    except TurbosparkError as exc:
        yield _sse(_refusal(exc, param).body)
    except Exception as exc:  # the headers are sent: report in-band, then end the stream
        yield _sse(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body)
    yield _sse("[DONE]")


async def chat_completions(request: Request) -> Response:
    service: Service = request.app.state.service
    body = await service.parse(request, ChatCompletionRequest)
    ids = service.chat_ids(body.messages)
    config = body.generation_config(service.chunk_size, service.default_max_tokens)
    ident = new_id("chatcmpl")
    if not body.stream:
        done = await service.complete(ids, config)
        return JSONResponse(
            ChatCompletion(
                id=ident,
                model=service.model_id,
                choices=[
                    ChatChoice(
                        message=AssistantMessage(content=done.text),
                        finish_reason=done.finish_reason,
                    )
                ],
                usage=Usage.from_stats(done.stats),
            ).model_dump()
        )

    first = True

    def render(chunk: Chunk) -> BaseModel | None:
        """The first event carries the role; empty deltas are not sent."""
        nonlocal first
        if chunk.finish_reason is None and not chunk.text and not first:
            return None
        delta = Delta(
            role="assistant" if first else None,
            content=chunk.text if chunk.text or first else None,
        )
        first = False
        choice = ChatChunkChoice(delta=delta, finish_reason=chunk.finish_reason)
        return ChatCompletionChunk(id=ident, model=service.model_id, choices=[choice])

    def usage_event(usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=ident, model=service.model_id, choices=[], usage=usage)

    events = _sse_stream(
        service.chunks(ids, config), render, usage_event if body.include_usage else None, "messages"
    )
    return StreamingResponse(events, media_type="text/event-stream")


async def completions(request: Request) -> Response:
    service: Service = request.app.state.service
    body = await service.parse(request, CompletionRequest)
    ids = service.completion_ids(body.prompt)
    config = body.generation_config(service.chunk_size, service.default_max_tokens)
    ident = new_id("cmpl")
    if not body.stream:
        done = await service.complete(ids, config)
        return JSONResponse(
            TextCompletion(
                id=ident,
                model=service.model_id,
                choices=[TextChoice(text=done.text, finish_reason=done.finish_reason)],
                usage=Usage.from_stats(done.stats),
            ).model_dump()
        )

    def render(chunk: Chunk) -> BaseModel | None:
        if not chunk.text and chunk.finish_reason is None:
            return None
        choice = TextChoice(text=chunk.text, finish_reason=chunk.finish_reason)
        return TextCompletion(id=ident, model=service.model_id, choices=[choice])

    def usage_event(usage: Usage) -> BaseModel:
        return TextCompletion(id=ident, model=service.model_id, choices=[], usage=usage)

    events = _sse_stream(
        service.chunks(ids, config), render, usage_event if body.include_usage else None, "prompt"
    )
    return StreamingResponse(events, media_type="text/event-stream")


async def models(request: Request) -> Response:
    service: Service = request.app.state.service
    cards = ModelList(data=[ModelCard(id=service.model_id, created=service.created)])
    return JSONResponse(cards.model_dump())


async def health(request: Request) -> Response:
    service: Service = request.app.state.service
    return JSONResponse({"status": "ok", "model": service.model_id})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error_response(
        APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    )


async def _server_error(request: Request, exc: Exception) -> Response:
    return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def create_app(
    runner: Runner,
    codec: TextCodec,
    *,
    model_id: str | None = None,
    chunk_size: int = 512,
    default_max_tokens: int | None = None,
    worker: RunnerWorker | None = None,
) -> Starlette:
    """The Starlette app serving *runner*. Prefix reuse is the caller's choice
    (``runner.set_prefix_reuse``); ``turbospark serve`` turns it on.

    Pass the *worker* whose thread opened the runner (``worker.run(lambda:
    Runner.open(...))``). Without one, a new worker thread serves a runner
    opened elsewhere; its model is evaluated here first, because MLX cannot
    evaluate on one thread what another thread left lazy (e.g. RoPE tables).
    """
    if worker is None:
        worker = RunnerWorker()
        mx.eval(runner.model)
    service = Service(
        runner,
        codec,
        model_id=model_id or runner.manifest.model_id,
        chunk_size=chunk_size,
        default_max_tokens=default_max_tokens,
        worker=worker,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        # SIGTERM ends up here: write every warm session, then stop the worker.
        await service.worker.call(service.runner.close)
        service.worker.shutdown()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        lifespan=lifespan,
    )
    app.state.service = service
    return app
