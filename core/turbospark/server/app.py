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

import asyncio
import contextlib
import functools
import json
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import mlx.core as mx
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from turbospark.distributed import Lockstep, LockstepEngine
from turbospark.engine import Engine
from turbospark.errors import TurbosparkError
from turbospark.generate import (
    Chunk,
    Completion,
    GenerationStats,
    check_prompt,
    collect,
    encode_prompt,
)
from turbospark.logits_processors import Grammar, GrammarCompiler
from turbospark.runner import Runner
from turbospark.server.access import access_middleware
from turbospark.server.bridge import LoopBridge
from turbospark.server.draws import Draw, chat_logprobs, draws, leads, text_logprobs
from turbospark.server.errors import (
    HANDLERS,
    APIError,
    ClientGone,
    error_json,
    refusal,
    validation_error,
)
from turbospark.server.limits import (
    DEADLINE_KEY,
    Admission,
    Deadline,
    SendDeadline,
    Ticket,
    read_body,
)
from turbospark.server.metrics import Metrics
from turbospark.server.openapi import openapi_document
from turbospark.server.prompt_bound import PromptBound
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
    Message,
    ModelCard,
    ModelList,
    ResponseFormat,
    TextChoice,
    TextCompletion,
    Usage,
    new_id,
)
from turbospark.server.sessions import ROUTES as PAGE_ROUTES
from turbospark.server.settings import ServerLimits
from turbospark.server.sse import TextEvent, sse
from turbospark.server.tools import (
    StreamSplitter,
    Tool,
    ToolCallDelta,
    ToolSyntax,
    check_choice,
)
from turbospark.server.worker import RunnerWorker
from turbospark.steering import SteeringPolicy
from turbospark.text import TextCodec

R = TypeVar("R", bound=BaseModel)  # every request body has a ``model``

DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streaming request checks its client
GIL_SWITCH_INTERVAL_S = 0.0005  # see Service.start: the runner thread gets the GIL back fast


class Service:
    """One runner, its text codec, the worker thread that owns them, the engine
    that batches their requests (:mod:`turbospark.engine`), and the limits.

    Prompts are rendered and tokenized on a small pool of their own, neither on
    the event loop (every other request would wait) nor on the runner thread
    (generation would wait); ``TextCodec.encode`` releases the GIL meanwhile.
    """

    def __init__(
        self,
        runner: Runner,
        codec: TextCodec,
        *,
        model_id: str,
        chunk_size: int,
        default_max_tokens: int | None,
        worker: RunnerWorker,
        limits: ServerLimits,
        engine: Engine,
    ) -> None:
        self.runner = runner
        self.codec = codec
        self.model_id = model_id
        self.chunk_size = chunk_size
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.worker = worker
        self.limits = limits
        self.admission = Admission(limits.max_queue)
        self.bound = PromptBound.of(codec.tokenizer)
        self.text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="turbospark-text")
        self.engine = engine
        self._loop_bridge: LoopBridge | None = None
        self._switch_interval = sys.getswitchinterval()
        self._stop = threading.Event()
        self._grammar: GrammarCompiler | None = None  # built on first use (a vocabulary walk)
        self._grammar_lock = threading.Lock()
        self.tool_syntax = ToolSyntax.of(codec.chat_template)  # how this template calls tools

    def start(self, warm_up: list[int] | None) -> None:
        """Warm up (when given prompt ids), then run the engine's loop on the
        runner thread until :meth:`stop`. Requests queue meanwhile."""
        self._stop.clear()
        self.engine.warming = warm_up is not None
        # The runner thread drops the GIL while it waits for a step's ids; the
        # event loop then formats every row's chunk. Python hands the GIL back
        # only after a switch interval (5 ms by default), which a 16-row step
        # paid every step. A short one lets the runner queue the next step as
        # soon as the ids are in.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

        def loop() -> None:
            if warm_up is not None:
                self.engine.warm_up(warm_up)
            self.engine.run(self._stop)

        self.worker.submit(loop)

    def stop(self) -> None:
        """SIGTERM ends up here: stop the loop, write every warm session to the
        disk tier (when there is one), then let the runner thread go."""
        self._stop.set()
        self.engine.wake()
        self.text_pool.shutdown(wait=True, cancel_futures=True)
        self.worker.run(self.runner.close)
        self.worker.shutdown()
        sys.setswitchinterval(self._switch_interval)

    async def response_grammar(
        self,
        response_format: ResponseFormat | None,
        deadline: Deadline,
        forced_call: str | None = None,
    ) -> Callable[[], Grammar] | None:
        """A factory of per-row grammar constraints for *response_format* (or a
        forced tool call's Lark grammar), the grammar checked on the text pool:
        one that cannot compile is a 400 naming its parameter."""
        if forced_call is not None:
            param, source = "tools", forced_call
        elif response_format is None or response_format.type == "text":
            return None
        else:
            spec = response_format.json_schema
            param, source = "response_format", spec.schema_ if spec is not None else None

        def compile_() -> Callable[[], Grammar]:
            compiler = self._grammar_compiler()
            try:
                grammar = source if isinstance(source, str) else compiler.json_schema(source)
                grammar = compiler.check(grammar, param)
            except (TurbosparkError, ValueError) as exc:
                raise APIError(400, str(exc), param=param, code="invalid_value") from exc
            return functools.partial(compiler.processor, grammar)

        future = asyncio.get_running_loop().run_in_executor(self.text_pool, compile_)
        return await deadline.run(future, "while the grammar was compiled")

    async def chat_draws(
        self, body: ChatCompletionRequest, deadline: Deadline
    ) -> tuple[list[Draw], ToolSyntax | None]:
        """A chat request's draws (its prompt rendered with its tools, a forced
        call's grammar) and, when tool calls are parsed out of the replies, the
        install's tool syntax bound to the request's tools (their parameter
        types). The Anthropic and Responses endpoints translate into this request."""
        why = check_choice(body.tools, body.tool_choice)
        if why is not None:
            raise APIError(400, why, param="tool_choice", code="invalid_value")
        calling = bool(body.tools) and body.tool_choice != "none"
        syntax = self.tool_syntax.bound(body.tools or [])
        try:
            forced = syntax.forced(body.tools or [], body.tool_choice) if calling else None
        except ValueError as exc:  # a schema the forcing grammar cannot follow
            raise APIError(400, str(exc), param="tools", code="invalid_value") from exc
        if forced is not None and body.response_format is not None:
            raise APIError(
                400,
                "response_format cannot be combined with a forced tool_choice",
                param="response_format",
                code="invalid_value",
            )
        ids = await self.prompt_ids(body.messages, deadline, body.tools)
        grammar = await self.response_grammar(body.response_format, deadline, forced)
        config = body.generation_config(
            self.chunk_size, self.default_max_tokens, self.steering_of(body)
        )
        choices = draws(
            [ids],
            body,
            config,
            vocab_size=self.codec.vocab_size,
            top_logprobs=body.kept_logprobs,
            grammar=grammar,
        )
        return choices, syntax if calling else None

    def steering_of(self, body: BaseRequest) -> SteeringPolicy | None:
        """The request's steering: the served setting (None), or its override of
        it, checked against the model here so a bad one is a 400 before queueing."""
        override = body.turbospark.steering if body.turbospark else None
        if override is None:
            return None
        if self.runner.group is not None:  # its directions would have to reach every rank
            raise APIError(
                400,
                "per-request steering is not carried between ranks under --distributed; start "
                "every rank with --steering instead",
                param="turbospark.steering",
                code="unsupported",
            )
        if override.mode == "off":
            return SteeringPolicy.off()
        try:
            steering = self.runner.steering.with_settings(
                override.scale, override.mode, override.layers
            )
            spec, arch = self.runner.family, self.runner.arch
            steering.check_model(
                spec.name, spec.steerable, arch.hidden_size, arch.num_hidden_layers
            )
        except TurbosparkError as exc:
            raise refusal(exc, "turbospark.steering") from None
        return steering

    async def run(self, request: Request, handler: Callable[..., Any], model: type[R]) -> Response:
        """Parse *model* within the request's deadline, take a queue place, and
        hand both to ``handler(service, body, deadline, ticket, request)``."""
        deadline = self.deadline(request)
        body = await self.parse(request, model, deadline)
        with self.admission.admit() as ticket:
            return await handler(self, body, deadline, ticket, request)

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler(
                    self.codec.tokenizer.to_str(), self.codec.eos_token_ids
                )
            return self._grammar

    def deadline(self, request: Request | None = None) -> Deadline:
        """*request*'s deadline, started by ``SendDeadline`` as it arrived (a new
        one when called outside a request)."""
        if request is not None and DEADLINE_KEY in request.scope:
            return request.scope[DEADLINE_KEY]
        return Deadline(self.limits.request_timeout)

    async def parse(self, request: Request, model: type[R], deadline: Deadline) -> R:
        raw = await deadline.run(
            read_body(request, self.limits.max_request_bytes), "while the body was sent", 408
        )
        try:
            data = json.loads(raw)
        except ValueError as exc:  # bad JSON or UTF-8, or an integer past Python's digit limit
            raise APIError(
                400, f"the request body is not valid JSON: {exc}", code="invalid_json"
            ) from exc
        except RecursionError:
            raise APIError(
                400, "the request body is nested too deeply to parse", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        asked = getattr(parsed, "model", None)
        if asked != self.model_id:
            raise APIError(
                404,
                f"the model '{asked}' does not exist; this server serves "
                f"'{self.model_id}' (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return parsed

    async def prompt_ids(
        self,
        prompt: list[Message] | str | list[int],
        deadline: Deadline,
        tools: list[Tool] | None = None,
    ) -> list[int]:
        """The prompt's ids, checked, rendered and tokenized on the text pool."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            work = functools.partial(self._completion_ids, prompt)
        else:
            work = functools.partial(self._chat_ids, prompt, tools)
        future = asyncio.get_running_loop().run_in_executor(self.text_pool, work)
        return await deadline.run(future, "while the prompt was tokenized")

    def _chat_ids(self, messages: list[Message], tools: list[Tool] | None) -> list[int]:
        extra: dict[str, Any] = {}
        if tools:
            if "tools" not in (self.codec.chat_template or ""):
                raise APIError(
                    400,
                    "tools are not supported by this install: its chat template does not "
                    "render them",
                    param="tools",
                    code="invalid_value",
                )
            extra["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        try:
            text = self.codec.apply_chat_template([m.template_dict() for m in messages], **extra)
        except TurbosparkError as exc:
            raise refusal(exc, "messages") from exc
        self._fits(len(text), "messages")
        return self._checked(self.codec.encode(text), "messages")

    def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self._fits(len(prompt), "prompt")
        return self._checked(encode_prompt(self.codec, prompt), "prompt")

    def _fits(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text that cannot fit the context (prompt_bound.py)."""
        least = self.bound.min_tokens(chars)
        if least > self.runner.context_length:
            raise APIError(
                400,
                f"the prompt is {chars} characters, so at least {least} tokens "
                f"({self.bound.why}), but the context length is {self.runner.context_length}; "
                "shorten the prompt or serve with a larger --context-length",
                param=param,
                code="context_length_exceeded",
            )

    def _checked(self, ids: list[int], param: str) -> list[int]:
        """Validate a prompt, refusing it as a 4xx before the runner sees it."""
        try:
            check_prompt(self.runner, ids)
        except TurbosparkError as exc:
            raise refusal(exc, param) from exc
        return ids

    def _bridge(self, loop: asyncio.AbstractEventLoop) -> LoopBridge:
        """The one bridge to *loop* (one wake-up per engine step for all its requests)."""
        if self._loop_bridge is None or self._loop_bridge.loop is not loop:
            self._loop_bridge = LoopBridge(loop)
        return self._loop_bridge

    async def chunks(
        self, draws: list[Draw], deadline: Deadline
    ) -> AsyncIterator[tuple[int, Chunk]]:
        """Each draw's chunks, tagged with its index, one at a time (:meth:`chunk_batches`)."""
        async with contextlib.aclosing(self.chunk_batches(draws, deadline)) as batches:
            async for batch in batches:
                for pair in batch:
                    yield pair

    async def chunk_batches(
        self, draws: list[Draw], deadline: Deadline
    ) -> AsyncIterator[list[tuple[int, Chunk]]]:
        """Each draw's chunks, tagged with its index, as the engine produces them,
        within the deadline: every chunk queued by the time the consumer asks,
        in order, so a stream that fell behind the engine catches up in one
        write. The draws are rows of the engine's batch. When the consumer
        stops (a client that left, the deadline, a draw that failed) every draw
        is cancelled: its row is freed at the engine's next step, and one given
        up while still queued never starts."""
        bridge = self._bridge(asyncio.get_running_loop())
        queue: asyncio.Queue[tuple[int, Chunk | Exception]] = asyncio.Queue()

        def emitter(index: int) -> Callable[[Chunk | Exception], None]:
            return lambda item: bridge.put(queue, (index, item))

        jobs = [draw.job(emitter(index)) for index, draw in enumerate(draws)]
        for job in leads(jobs):  # one prefill per prompt, its other choices forked
            self.engine.submit(job)
        running = len(jobs)
        # One timer for the whole generation puts the deadline's error in the
        # queue, instead of a timeout armed around every chunk's wait.
        remaining = deadline.remaining()
        timer = None
        if remaining is not None:
            overdue = deadline.error("while generating")
            timer = asyncio.get_running_loop().call_later(
                remaining, queue.put_nowait, (-1, overdue)
            )
        try:
            while running:
                if deadline.expired:  # chunks queued ahead of the timer's error
                    raise deadline.error("while generating")
                batch: list[tuple[int, Chunk]] = []
                failed: Exception | None = None
                pair = await queue.get()
                while True:
                    index, item = pair
                    if isinstance(item, Exception):
                        failed = item
                        break
                    batch.append((index, item))
                    if item.finish_reason is not None:
                        running -= 1
                    if not running or queue.empty():
                        break
                    pair = queue.get_nowait()
                if batch:
                    yield batch
                if failed is not None:
                    raise failed
        finally:
            if timer is not None:
                timer.cancel()
            for job in jobs:
                job.cancelled.set()
            self.engine.wake()

    async def complete(
        self, draws: list[Draw], deadline: Deadline, request: Request
    ) -> list[Completion]:
        """Every draw's whole completion; a client that hangs up meanwhile frees the rows."""

        async def gather() -> list[Completion]:
            parts: list[list[Chunk]] = [[] for _ in draws]
            async for index, chunk in self.chunks(draws, deadline):
                parts[index].append(chunk)
            return [collect(chunks) for chunks in parts]

        task = asyncio.ensure_future(gather())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # closes the stream: the engine drops the rows next step
                raise ClientGone
        return task.result()


class EventStream(StreamingResponse):
    """An SSE response that holds its request's queue place until it ends,
    however it ends (finished, failed, cancelled by a disconnect, or abandoned
    with a client that stopped reading): then its events' generator is closed,
    which cancels the generation at the engine's next step."""

    def __init__(self, events: AsyncGenerator[str, None], ticket: Ticket) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events
        self.ticket = ticket

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()
            await self.events.aclose()


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


def _message(text: str, syntax: ToolSyntax | None) -> AssistantMessage:
    """The reply, its tool-call blocks parsed out when the request offered tools."""
    if syntax is None:
        return AssistantMessage(content=text)
    prose, calls = syntax.parse(text)
    return AssistantMessage(content=prose or None, tool_calls=calls or None)


def _finish(done: Completion, syntax: ToolSyntax | None) -> str:
    if syntax is not None and done.finish_reason == "stop" and syntax.parse(done.text)[1]:
        return "tool_calls"
    return done.finish_reason


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
    choices, syntax = await service.chat_draws(body, deadline)
    ident = new_id("chatcmpl")
    codec = service.codec
    if not body.stream:
        done = await service.complete(choices, deadline, request)
        return JSONResponse(
            ChatCompletion(
                id=ident,
                model=service.model_id,
                choices=[
                    ChatChoice(
                        index=i,
                        message=_message(d.text, syntax),
                        finish_reason=_finish(d, syntax),
                        logprobs=chat_logprobs(codec, d.tokens, d.logprobs)
                        if body.logprobs
                        else None,
                    )
                    for i, d in enumerate(done)
                ],
                usage=Usage.of_choices([d.stats for d in done], body.n),
            ).model_dump()
        )

    started: set[int] = set()
    splitters: dict[int, StreamSplitter] = {}
    created = int(time.time())  # every chunk of one completion carries the same time
    texts: dict[int, TextEvent] = {}

    def render(index: int, chunk: Chunk) -> BaseModel | str | None:
        """Each choice's first event carries the role; empty deltas are not sent.
        A plain text delta (most events) is filled into its pre-encoded event."""
        first = index not in started
        if chunk.finish_reason is None and not chunk.logprobs and not first:
            if not chunk.text:
                return None
            if syntax is None:
                if index not in texts:
                    texts[index] = TextEvent(chunk_of(index, Delta(content=TextEvent.MARK)))
                return texts[index](chunk.text)
        started.add(index)
        text, calls, finish = chunk.text, None, chunk.finish_reason
        if syntax is not None:  # prose goes out at once; tool-call blocks when the choice ends
            splitter = splitters.setdefault(index, StreamSplitter(syntax))
            text = splitter.feed(text)
            if finish is not None:
                tail, parsed = splitter.finish()
                text += tail
                if parsed:
                    calls = [ToolCallDelta(index=k, **c.model_dump()) for k, c in enumerate(parsed)]
                    finish = "tool_calls" if finish == "stop" else finish
        delta = Delta(
            role="assistant" if first else None,
            content=text if text or (first and not calls) else None,
            tool_calls=calls,
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
            id=ident, created=created, model=service.model_id, choices=[], usage=usage
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


def new_engine(
    runner: Runner, codec: TextCodec, max_batch: int, prefill_budget: int, lockstep: Lockstep | None
) -> Engine:
    """The server's engine; under ``serve --distributed`` every rank builds it here."""
    if lockstep is None:
        return Engine(runner, codec, max_batch=max_batch, prefill_budget=prefill_budget)
    return LockstepEngine(runner, codec, lockstep, max_batch=max_batch, prefill_budget=prefill_budget)  # fmt: skip


def create_app(
    runner: Runner,
    codec: TextCodec,
    *,
    model_id: str | None = None,
    chunk_size: int = 512,
    prefill_budget: int | None = None,
    default_max_tokens: int | None = None,
    worker: RunnerWorker | None = None,
    limits: ServerLimits | None = None,
    max_batch: int = 8,
    warm_up: list[int] | None = None,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    lockstep: Lockstep | None = None,
) -> Starlette:
    """The Starlette app serving *runner*. Prefix reuse is the caller's choice
    (``runner.set_prefix_reuse``); ``turbospark serve`` turns it on. Up to
    *max_batch* requests decode together (:mod:`turbospark.engine`); the rest
    wait in arrival order; each step prefills at most *prefill_budget* prompt
    tokens in all (default: *chunk_size*). With *warm_up* prompt ids, the engine runs them
    (alone and batched) before it admits the first request; ``/health`` says
    ``warming`` meanwhile. With *api_key*, conversations and the sessions view
    need it; *cors_origins* lets those browser origins in (``server/access.py``).
    With *lockstep* (rank 0 of ``serve --distributed``) the engine steps in
    lockstep with the other ranks (:mod:`turbospark.distributed`).

    Pass the *worker* whose thread opened the runner (``worker.run(lambda:
    Runner.open(...))``). Without one, a new worker thread serves a runner
    opened elsewhere; its model is evaluated here first, because MLX cannot
    evaluate on one thread what another thread left lazy (e.g. RoPE tables).
    """
    from turbospark.server import (  # they build on this module
        anthropic,
        embeddings,
        gateway,
        responses,
    )

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
        engine=new_engine(runner, codec, max_batch, prefill_budget or chunk_size, lockstep),
    )
    metrics = Metrics(service.engine)
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
            Route(
                "/v1/embeddings", metrics.counted("embeddings", embeddings.create), methods=["POST"]
            ),
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
    app.state.metrics = metrics
    return app
