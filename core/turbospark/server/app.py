"""The OpenAI-compatible HTTP API over one runner.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE
streaming), Anthropic's ``POST /v1/messages`` (``anthropic.py``) and OpenAI's
``POST /v1/responses`` (``responses.py``), translated onto the chat path,
``POST /v1/embeddings`` (``embeddings.py``: pooled hidden states, no session touched),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus:
``metrics.py``), ``GET /openapi.json`` (the request and response schemas,
generated from the pydantic models), and the
page for people with its sessions view (``GET /``, ``GET /turbospark/sessions``:
``sessions.py``). There are no conversation ids:
the runner picks the session by token content (SEMANTICS.md), so any OpenAI
client gets prefix reuse by simply resending its conversation.

Every refusal is an OpenAI-style error body ``{"error": {message, type, param,
code}}`` with a 4xx status, decided *before* the request reaches the runner,
so a bad request never touches a session and the server keeps serving. What
one request may hold (bytes, a queue place, time) is bounded in ``limits.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import mlx.core as mx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbospark.generation.distributed import Lockstep, LockstepEngine
from turbospark.generation.engine import Engine
from turbospark.generation.runner import Runner
from turbospark.server import anthropic, embeddings, gateway, ollama, responses
from turbospark.server.access import access_middleware
from turbospark.server.chat import chat_completions, completions, health, model, models
from turbospark.server.errors import (
    HANDLERS,
)
from turbospark.server.limits import (
    SendDeadline,
)
from turbospark.server.metrics import Metrics, ResponseStoreCollector
from turbospark.server.openapi import openapi_document
from turbospark.server.response_store import ResponseStore, ResponseStoreLimits
from turbospark.server.service import Service
from turbospark.server.sessions import ROUTES as PAGE_ROUTES
from turbospark.server.settings import PREFILL_GATHER_S, ServerLimits
from turbospark.server.window import ContextOverflow
from turbospark.server.worker import RunnerWorker
from turbospark.text import TextCodec


def new_engine(
    runner: Runner,
    codec: TextCodec,
    max_batch: int,
    prefill_budget: int,
    lockstep: Lockstep | None,
    gather_s: float = PREFILL_GATHER_S,
) -> Engine:
    """The server's engine; under ``serve --distributed`` every rank builds it here
    (where admission never waits for requests on their way in: ``LockstepEngine``)."""
    if lockstep is None:
        return Engine(
            runner, codec, max_batch=max_batch, prefill_budget=prefill_budget, gather_s=gather_s
        )
    return LockstepEngine(runner, codec, lockstep, max_batch=max_batch, prefill_budget=prefill_budget)  # fmt: skip


def create_app(
    runner: Runner,
    codec: TextCodec,
    *,
    model_id: str | None = None,
    chunk_size: int = 512,
    prefill_budget: int | None = None,
    gather_s: float = PREFILL_GATHER_S,
    default_max_tokens: int | None = None,
    worker: RunnerWorker | None = None,
    limits: ServerLimits | None = None,
    max_batch: int = 8,
    warm_up: list[int] | None = None,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    lockstep: Lockstep | None = None,
    context_overflow: ContextOverflow = "refuse",
    response_store: ResponseStoreLimits | None = None,
) -> Starlette:
    """The Starlette app serving *runner*. Prefix reuse is the caller's choice
    (``runner.set_prefix_reuse``); ``turbospark serve`` turns it on. Up to
    *max_batch* requests decode together (:mod:`turbospark.generation.engine`); the rest
    wait in arrival order; each step prefills at most *prefill_budget* prompt
    tokens in all (default: *chunk_size*), and a queued prompt waits at most
    *gather_s* for requests whose prompts are still being prepared, so that a
    burst prefills together (``Engine.expect``). With *warm_up* prompt ids, the engine runs them
    (alone and batched) as soon as it starts, and a request that arrives
    meanwhile cuts the warm-up short (``Engine.warm_up``); ``/health`` says
    ``warming`` until it ends. With *api_key*, conversations and the sessions view
    need it; *cors_origins* lets those browser origins in (``server/access.py``).
    With *lockstep* (rank 0 of ``serve --distributed``) the engine steps in
    lockstep with the other ranks (:mod:`turbospark.generation.distributed`).
    *context_overflow* says what a chat past the context gets: a 400
    (``refuse``) or its oldest turns dropped (``drop-turns``, ``window.py``).
    Stored Responses are bounded by *response_store* and, when the runner has a
    session directory, written to its ``responses/`` beside the session files.

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
        limits=limits or ServerLimits(),
        engine=new_engine(
            runner, codec, max_batch, prefill_budget or chunk_size, lockstep, gather_s
        ),
        context_overflow=context_overflow,
    )
    disk = runner.session_disk
    responses_store = ResponseStore(
        response_store or ResponseStoreLimits(),
        None if disk is None else disk.root / "responses",
    )
    metrics = Metrics(service.engine)
    metrics.registry.register(ResponseStoreCollector(responses_store))
    service.engine.observer = metrics.observe
    schema = openapi_document()

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.start(warm_up)
        yield
        service.stop()

    app = Starlette(
        routes=[
            Route(
                "/v1/chat/completions",
                metrics.counted("chat.completions", chat_completions),
                methods=["POST"],
            ),
            Route("/v1/completions", metrics.counted("completions", completions), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/v1/messages", anthropic.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
            Route("/v1/responses", responses.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
            Route(
                "/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]
            ),
            Route(
                "/v1/embeddings", metrics.counted("embeddings", embeddings.create), methods=["POST"]
            ),
            *ollama.ROUTES,
            *PAGE_ROUTES,
            *gateway.ROUTES,
        ],
        exception_handlers=HANDLERS,
        lifespan=lifespan,
        middleware=[
            Middleware(
                SendDeadline,
                request_timeout=service.limits.request_timeout,
                send_timeout=service.limits.send_timeout,
            ),
            *access_middleware(api_key, cors_origins),
        ],
    )
    app.state.service = service
    app.state.responses = responses_store
    app.state.metrics = metrics
    return app
