"""The server's one service over the runner: admission, deadlines, the engine's thread, and what every route shares.

Each route module (``chat.py``, ``anthropic.py``, ``responses.py``, ``embeddings.py``,
``sessions.py``, ``gateway.py``) reads the :class:`Service` from ``request.app.state``;
``app.py`` assembles them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from turbospark.errors import TurbosparkError
from turbospark.generation.engine import Arrival, Engine
from turbospark.generation.generate import (
    Chunk,
    Completion,
    check_prompt,
    collect,
    encode_prompt,
)
from turbospark.generation.logits_processors import Grammar, GrammarCompiler
from turbospark.generation.runner import Runner
from turbospark.policies.steering import SteeringPolicy
from turbospark.server.bridge import Inbox, LoopBridge
from turbospark.server.chat_ids import ChatIds, chat_ids
from turbospark.server.draws import Draw, draws, leads
from turbospark.server.errors import (
    APIError,
    ClientGone,
    refusal,
    validation_error,
)
from turbospark.server.limits import (
    DEADLINE_KEY,
    Admission,
    Deadline,
    Ticket,
    read_body,
)
from turbospark.server.prompt_bound import PromptBound
from turbospark.server.reasoning import Reasoning
from turbospark.server.schemas import (
    BaseRequest,
    ChatCompletionRequest,
    Message,
    ResponseFormat,
    TurbosparkUsage,
)
from turbospark.server.settings import ServerLimits
from turbospark.server.tools import (
    Tool,
    ToolSyntax,
    check_choice,
)
from turbospark.server.window import ContextOverflow, Dropped, fit
from turbospark.server.worker import RunnerWorker
from turbospark.text import TextCodec

R = TypeVar("R", bound=BaseModel)  # every request body has a ``model``
# The request's announcement to the engine (Engine.expect), from when its prompt
# is prepared until its jobs are submitted: both happen in the request's task.
_ARRIVING: ContextVar[Arrival | None] = ContextVar("turbospark_arriving", default=None)

DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streaming request checks its client
GIL_SWITCH_INTERVAL_S = 0.0005  # see Service.start: the runner thread gets the GIL back fast


def _take_back() -> None:
    """End this request's announcement to the engine, if it has one."""
    arrival = _ARRIVING.get()
    if arrival is not None:
        arrival.done()
        _ARRIVING.set(None)


@dataclass(frozen=True)
class ChatDraws:
    """A chat request made ready: its draws; when tool calls are parsed out of
    the replies, the install's tool syntax bound to the request's tools; how
    the replies' reasoning is split off (None: it is not); and what window
    fitting dropped from the conversation."""

    draws: list[Draw]
    syntax: ToolSyntax | None
    reasoning: Reasoning | None
    dropped: Dropped

    def report_dropped(self, usage: TurbosparkUsage) -> None:
        """Say in *usage* (every route's ``usage.turbospark``) what window fitting
        dropped, in its fields and in the reuse detail."""
        if self.dropped.messages:
            usage.dropped_messages = self.dropped.messages
            usage.dropped_tokens = self.dropped.tokens
            usage.reuse_detail += (
                f"; the {self.dropped.messages} oldest message(s) ({self.dropped.tokens} "
                "tokens) were dropped to fit the context"
            )


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    text: str  # the rendered prompt the ids encode
    dropped: Dropped
    checkpoint_at: int | None = None  # where the next turn leaves the generation prompt
    note: str = ""  # how re-sent replies were fed, for the reuse detail


class Service:
    """One runner, its text codec, the worker thread that owns them, the engine
    that batches their requests (:mod:`turbospark.generation.engine`), and the limits.

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
        context_overflow: ContextOverflow = "refuse",
    ) -> None:
        self.runner = runner
        self.codec = codec
        self.model_id = model_id
        self.chunk_size = chunk_size
        self.default_max_tokens = default_max_tokens
        self.context_overflow: ContextOverflow = context_overflow
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
        # How this family's models call tools: the family says, from the install's template.
        self.tool_syntax = ToolSyntax.named(runner.tool_syntax(codec.chat_template))

    def start(self, warm_up: list[int] | None) -> None:
        """Warm up (when given prompt ids), then run the engine's loop on the
        runner thread until :meth:`stop`. A request that queues during the
        warm-up cuts it short (``Engine.warm_up``)."""
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
        # Starlette streams a reply through anyio's asyncio backend, which anyio
        # imports at its first use: 75 ms of the first streamed reply's time to
        # first token on the CPU. Imported here, on the text pool, it overlaps
        # the warm-up and the wait for a first request instead (a name anyio
        # moves only leaves the import undone: the future is never read).
        self.text_pool.submit(importlib.import_module, "anyio._backends._asyncio")

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
        self,
        body: ChatCompletionRequest,
        deadline: Deadline,
        overflow: ContextOverflow | None = None,
    ) -> ChatDraws:
        """A chat request's draws (its prompt rendered with its tools and template
        arguments, a forced call's grammar), with how to read the replies
        (:class:`ChatDraws`). A conversation past the context is refused or
        loses its oldest turns, as *overflow* says (default: the server's
        ``--context-overflow``). The Anthropic and Responses endpoints translate
        into this request."""
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
        config = body.generation_config(
            self.chunk_size, self.default_max_tokens, self.steering_of(body)
        )
        dropping = (overflow or self.context_overflow) == "drop-turns"
        room = (config.max_tokens if config.max_tokens is not None else 1) if dropping else None
        work = functools.partial(
            self._chat_prompt, body.messages, body.tools, body.chat_template_kwargs, room
        )
        self._announce()
        future = asyncio.get_running_loop().run_in_executor(self.text_pool, work)
        prompt = await deadline.run(future, "while the prompt was tokenized")
        grammar = await self.response_grammar(body.response_format, deadline, forced)
        choices = draws(
            [prompt.ids],
            body,
            config,
            vocab_size=self.codec.vocab_size,
            top_logprobs=body.kept_logprobs,
            grammar=grammar,
        )
        for draw in choices:
            draw.checkpoint_at, draw.prompt_note = prompt.checkpoint_at, prompt.note
        reasoning = Reasoning.of(prompt.text, self.codec.chat_template, grammar is not None)
        return ChatDraws(choices, syntax if calling else None, reasoning, prompt.dropped)

    @functools.cached_property
    def user_after_tool_results(self) -> bool:
        """Whether the install's template renders a user message right after tool
        results. Alternating templates (Gemma's: tool results are a user turn)
        refuse it, so a translated turn holding results and text must join them
        (``anthropic.py``); the template, not the family's name, says so."""
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
        probe = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "r"},
            {"role": "user", "content": "q"},
        ]
        try:
            self.codec.apply_chat_template(probe)
        except TurbosparkError:
            return False
        return True

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
            try:
                return await handler(self, body, deadline, ticket, request)
            except BaseException:
                _take_back()  # refused after its prompt was prepared, before submitting
                raise

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
        template_kwargs: dict[str, Any] | None = None,
        announce: bool = True,
    ) -> list[int]:
        """The prompt's ids, checked, rendered and tokenized on the text pool;
        with *announce*, the engine is told a job is coming (:meth:`_announce`):
        False where none will be, as when only counting tokens."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            work = functools.partial(self._completion_ids, prompt)
        else:
            work = functools.partial(self._chat_ids, prompt, tools, template_kwargs)
        if announce:
            self._announce()
        future = asyncio.get_running_loop().run_in_executor(self.text_pool, work)
        return await deadline.run(future, "while the prompt was tokenized")

    def _announce(self) -> None:
        """Tell the engine this request's jobs are coming (:meth:`Engine.expect`)
        while its prompt is prepared, so that a burst of requests prefills
        together. :meth:`chunk_batches` takes the announcement back when the
        jobs are submitted, :meth:`run` when the request fails or is refused
        before that."""
        _take_back()  # a request that prepares several prompts
        _ARRIVING.set(self.engine.expect())

    def _chat_ids(
        self,
        messages: list[Message],
        tools: list[Tool] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        return self._chat_prompt(messages, tools, template_kwargs).ids

    def _chat_prompt(
        self,
        messages: list[Message],
        tools: list[Tool] | None,
        template_kwargs: dict[str, Any] | None = None,
        room: int | None = None,
    ) -> ChatPrompt:
        """The chat's prompt. With *room* (window fitting), the oldest turns are
        dropped until the prompt leaves that many tokens for the reply."""
        extra: dict[str, Any] = dict(template_kwargs or {})
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
        built: dict[int, ChatIds] = {}  # id() of an encoding -> how it was built

        def render(dicts: list[dict[str, Any]], generation_prompt: bool) -> str:
            return self.codec.apply_chat_template(
                dicts, add_generation_prompt=generation_prompt, **extra
            )

        def fits(text: str) -> None:
            if room is None:  # fitting drops turns instead
                self._fits(len(text), "messages")

        def encode(kept: list[Message]) -> list[int]:
            try:
                prompt = chat_ids(
                    [m.template_dict() for m in kept],
                    render,
                    self.codec,
                    self.engine.replies,
                    boundary=self._checkpoints,
                    check=fits,
                )
            except TurbosparkError as exc:
                raise refusal(exc, "messages") from exc
            built[id(prompt.ids)] = prompt
            return prompt.ids

        if room is None:
            ids, dropped = encode(messages), Dropped()
        else:
            ids, dropped = fit(messages, encode, room, self.runner.context_length)
        prompt = built[id(ids)]
        return ChatPrompt(
            self._checked(ids, "messages"), prompt.text, dropped, prompt.checkpoint_at, prompt.note
        )

    @functools.cached_property
    def _checkpoints(self) -> bool:
        """Whether the model holds state that cannot rewind, so a checkpoint where
        the next turn leaves the generation prompt is worth finding (chat_ids.py)."""
        return any(c.rewindable is False for c in self.runner.family.components)

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
        inbox: Inbox[tuple[int, Chunk | Exception]] = Inbox()

        def emitter(index: int) -> Callable[[Chunk | Exception], None]:
            return lambda item: bridge.put(inbox, (index, item))

        jobs = [draw.job(emitter(index)) for index, draw in enumerate(draws)]
        for job in leads(jobs):  # one prefill per prompt, its other choices forked
            self.engine.submit(job)
        _take_back()
        running = len(jobs)
        # One timer for the whole generation puts the deadline's error in the
        # inbox, instead of a timeout armed around every chunk's wait.
        remaining = deadline.remaining()
        timer = None
        if remaining is not None:
            overdue = deadline.error("while generating")
            timer = asyncio.get_running_loop().call_later(
                remaining, inbox.put_nowait, (-1, overdue)
            )
        try:
            while running:
                if deadline.expired:  # chunks queued ahead of the timer's error
                    raise deadline.error("while generating")
                batch: list[tuple[int, Chunk]] = []
                failed: Exception | None = None
                for index, item in await inbox.take():
                    if isinstance(item, Exception):
                        failed = item
                        break
                    batch.append((index, item))
                    if item.finish_reason is not None:
                        running -= 1
                        if not running:
                            break
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
    which cancels the generation at the engine's next step, and the request's
    announcement to the engine is taken back, which its generator does only
    once it submits (a client gone before the first event never runs it)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], ticket: Ticket) -> None:
        super().__init__(events, media_type=self.media_type)
        self.events = events
        self.ticket = ticket
        self.arrival = _ARRIVING.get()  # made in the handler's task, which prepared the prompt
        # Told, once the stream ends, whether it was sent whole (False: the client
        # left first); the metrics count the request then, not when it started.
        self.on_end: Callable[[bool], None] | None = None
        self._whole = False

    async def stream_response(self, send: Any) -> None:
        await super().stream_response(send)
        self._whole = True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()
            if self.arrival is not None:
                self.arrival.done()  # a second done (after submitting) changes nothing
            await self.events.aclose()
            if self.on_end is not None:
                self.on_end(self._whole)
