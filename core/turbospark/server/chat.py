"""OpenAI's ``POST /v1/chat/completions`` and ``POST /v1/completions`` (SSE streaming or not), ``GET /v1/models`` and ``GET /health``."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turbospark.errors import TurbosparkError
from turbospark.generation.generate import (
    Chunk,
    GenerationStats,
)
from turbospark.server.draws import chat_logprobs, draws, text_logprobs
from turbospark.server.errors import (
    APIError,
    error_json,
    refusal,
)
from turbospark.server.limits import (
    Deadline,
    Ticket,
)
from turbospark.server.reasoning import Reasoning, ReasoningSplitter
from turbospark.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    TextChoice,
    TextCompletion,
    Usage,
    new_id,
)
from turbospark.server.service import ChatDraws, EventStream, Service
from turbospark.server.sse import TextEvent, sse
from turbospark.server.tools import (
    StreamSplitter,
    ToolCallDelta,
    ToolSyntax,
)


async def _sse_stream(
    batches: AsyncGenerator[list[tuple[int, Chunk]], None],
    render: Callable[[int, Chunk], BaseModel | str | None],
    usage_event: Callable[[Usage], BaseModel] | None,
    n: int,
    param: str,
) -> AsyncIterator[str]:
    """SSE events for the choices' chunks, the events of the chunks that came
    together sent in one write; the usage event (when asked) comes once every
    choice is done. An error after the headers went out can only be reported
    in-band, as an ``error`` event."""
    stats: dict[int, GenerationStats] = {}
    try:
        async for batch in batches:
            events = []
            for index, chunk in batch:
                event = render(index, chunk)
                if isinstance(event, str):  # pre-encoded (sse.TextEvent)
                    events.append(event)
                elif event is not None:
                    events.append(sse(event))
                if chunk.stats is not None:
                    stats[index] = chunk.stats
            if events:
                yield "".join(events)
        if usage_event is not None:
            yield sse(usage_event(Usage.of_choices([stats[i] for i in sorted(stats)], n)))
    except APIError as exc:  # the deadline
        yield sse(error_json(exc.body))
    except TurbosparkError as exc:
        yield sse(error_json(refusal(exc, param).body))
    except Exception as exc:  # the headers are sent: report in-band, then end the stream
        yield sse(error_json(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body))
    finally:
        await batches.aclose()  # an abandoned stream frees its engine rows now
    yield sse("[DONE]")


def _message(text: str, syntax: ToolSyntax | None, reasoning: Reasoning | None) -> AssistantMessage:
    """The reply, its reasoning split off, and its tool-call blocks parsed out of
    the answer when the request offered tools."""
    thought, text = reasoning.split(text) if reasoning is not None else (None, text)
    if syntax is None:
        return AssistantMessage(content=text, reasoning_content=thought)
    prose, calls = syntax.parse(text)
    return AssistantMessage(
        content=prose or None, tool_calls=calls or None, reasoning_content=thought
    )


def _finish(message: AssistantMessage, finish: str) -> str:
    return "tool_calls" if message.tool_calls and finish == "stop" else finish


def _usage(usage: Usage, plan: ChatDraws) -> Usage:
    """*usage* with what window fitting dropped (:meth:`ChatDraws.report_dropped`)."""
    plan.report_dropped(usage.turbospark)
    return usage


async def chat_completions(request: Request) -> Response:
    service: Service = request.app.state.service
    return await service.run(request, _chat, ChatCompletionRequest)


async def _chat(
    service: Service,
    body: ChatCompletionRequest,
    deadline: Deadline,
    ticket: Ticket,
    request: Request,
) -> Response:
    plan = await service.chat_draws(body, deadline)
    choices, syntax, reasoning = plan.draws, plan.syntax, plan.reasoning
    ident = new_id("chatcmpl")
    codec = service.codec
    if not body.stream:
        done = await service.complete(choices, deadline, request)
        messages = [_message(d.text, syntax, reasoning) for d in done]
        return JSONResponse(
            ChatCompletion(
                id=ident,
                model=service.model_id,
                choices=[
                    ChatChoice(
                        index=i,
                        message=messages[i],
                        finish_reason=_finish(messages[i], d.finish_reason),
                        logprobs=chat_logprobs(codec, d.tokens, d.logprobs)
                        if body.logprobs
                        else None,
                    )
                    for i, d in enumerate(done)
                ],
                usage=_usage(Usage.of_choices([d.stats for d in done], body.n), plan),
            ).model_dump()
        )

    started: set[int] = set()
    splitters: dict[int, StreamSplitter] = {}
    thinking: dict[int, ReasoningSplitter] = {}
    created = int(time.time())  # every chunk of one completion carries the same time
    texts: dict[int, TextEvent] = {}

    def render(index: int, chunk: Chunk) -> BaseModel | str | None:
        """Each choice's first event carries the role; empty deltas are not sent.
        A plain text delta (most events) is filled into its pre-encoded event."""
        first = index not in started
        if chunk.finish_reason is None and not chunk.logprobs and not first:
            if not chunk.text:
                return None
            if syntax is None and (reasoning is None or thinking[index].answering):
                if index not in texts:
                    texts[index] = TextEvent(chunk_of(index, Delta(content=TextEvent.MARK)))
                return texts[index](chunk.text)
        started.add(index)
        text, calls, finish = chunk.text, None, chunk.finish_reason
        thought = None
        if reasoning is not None:  # the reasoning first; the answer goes on below
            split = thinking.setdefault(index, reasoning.splitter())
            thought, text = split.take(text, finish is not None)
        if syntax is not None:  # prose goes out at once; tool-call blocks when the choice ends
            splitter = splitters.setdefault(index, StreamSplitter(syntax))
            text = splitter.feed(text)
            if finish is not None:
                tail, parsed = splitter.finish()
                text += tail
                if parsed:
                    calls = [ToolCallDelta(index=k, **c.model_dump()) for k, c in enumerate(parsed)]
                    finish = "tool_calls" if finish == "stop" else finish
        if not (first or text or thought or calls or finish or chunk.logprobs):
            return None  # all held back (a marker may be starting)
        delta = Delta(
            role="assistant" if first else None,
            content=text if text or (first and not calls and not thought) else None,
            tool_calls=calls,
            reasoning_content=thought or None,
        )
        logprobs = None
        if chunk.logprobs is not None and chunk.token is not None:
            logprobs = chat_logprobs(codec, [chunk.token], [chunk.logprobs])
        return chunk_of(index, delta, finish, logprobs)

    def chunk_of(
        index: int, delta: Delta, finish: str | None = None, logprobs: Any = None
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        return ChatCompletionChunk(
            id=ident, created=created, model=service.model_id, choices=[choice]
        )

    def usage_event(usage: Usage) -> BaseModel:
        return ChatCompletionChunk(
            id=ident, created=created, model=service.model_id, choices=[], usage=_usage(usage, plan)
        )

    events = _sse_stream(
        service.chunk_batches(choices, deadline),
        render,
        usage_event if body.include_usage else None,
        body.n,
        "messages",
    )
    return EventStream(events, ticket.hand_over())


async def completions(request: Request) -> Response:
    service: Service = request.app.state.service
    return await service.run(request, _complete, CompletionRequest)


async def _complete(
    service: Service,
    body: CompletionRequest,
    deadline: Deadline,
    ticket: Ticket,
    request: Request,
) -> Response:
    prompts = [await service.prompt_ids(prompt, deadline) for prompt in body.prompts]
    config = body.generation_config(
        service.chunk_size, service.default_max_tokens, service.steering_of(body)
    )
    choices = draws(
        prompts,
        body,
        config,
        vocab_size=service.codec.vocab_size,
        top_logprobs=body.kept_logprobs,
    )
    codec = service.codec
    # echo: each choice's text starts with its prompt (ids given are decoded).
    echoes = [
        (p if isinstance(p, str) else codec.decode(p)) if body.echo else "" for p in body.prompts
    ]
    ident = new_id("cmpl")
    if not body.stream:
        done = await service.complete(choices, deadline, request)
        return JSONResponse(
            TextCompletion(
                id=ident,
                model=service.model_id,
                choices=[
                    TextChoice(
                        index=i,
                        text=echoes[i // body.n] + d.text,
                        finish_reason=d.finish_reason,
                        logprobs=text_logprobs(codec, d.tokens, d.logprobs)
                        if body.logprobs is not None
                        else None,
                    )
                    for i, d in enumerate(done)
                ],
                usage=Usage.of_choices([d.stats for d in done], body.n),
            ).model_dump()
        )

    offsets: dict[int, int] = {}
    created = int(time.time())  # every chunk of one completion carries the same time
    texts: dict[int, TextEvent] = {}

    def render(index: int, chunk: Chunk) -> BaseModel | str | None:
        echo = echoes[index // body.n] if index not in offsets else ""
        if not chunk.text and not echo and chunk.finish_reason is None and not chunk.logprobs:
            return None
        if not echo and chunk.finish_reason is None and not chunk.logprobs and index in offsets:
            offsets[index] += len(chunk.text)  # a plain text delta: its pre-encoded event
            if index not in texts:
                texts[index] = TextEvent(text_chunk(TextChoice(index=index, text=TextEvent.MARK)))
            return texts[index](chunk.text)
        offset = offsets.setdefault(index, 0)
        logprobs = None
        if chunk.logprobs is not None and chunk.token is not None:
            logprobs = text_logprobs(codec, [chunk.token], [chunk.logprobs], offset)
        offsets[index] = offset + len(chunk.text)
        choice = TextChoice(
            index=index,
            text=echo + chunk.text,
            finish_reason=chunk.finish_reason,
            logprobs=logprobs,
        )
        return text_chunk(choice)

    def text_chunk(choice: TextChoice) -> TextCompletion:
        return TextCompletion(id=ident, created=created, model=service.model_id, choices=[choice])

    def usage_event(usage: Usage) -> BaseModel:
        return TextCompletion(
            id=ident, created=created, model=service.model_id, choices=[], usage=usage
        )

    events = _sse_stream(
        service.chunk_batches(choices, deadline),
        render,
        usage_event if body.include_usage else None,
        body.n,
        "prompt",
    )
    return EventStream(events, ticket.hand_over())


async def models(request: Request) -> Response:
    service: Service = request.app.state.service
    cards = ModelList(data=[ModelCard(id=service.model_id, created=service.created)])
    return JSONResponse(cards.model_dump())


async def model(request: Request) -> Response:
    service: Service = request.app.state.service
    name = request.path_params["model"]
    if name != service.model_id:
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server serves '{service.model_id}'",
            param="model",
            code="model_not_found",
        )
    return JSONResponse(ModelCard(id=service.model_id, created=service.created).model_dump())


async def health(request: Request) -> Response:
    service: Service = request.app.state.service
    engine = service.engine
    return JSONResponse(
        {
            "status": "warming" if engine.warming else "ok",
            "model": service.model_id,
            "queue_depth": engine.queue_depth,
            "active_rows": engine.active_rows,
            "max_batch": engine.max_batch,
        }
    )
