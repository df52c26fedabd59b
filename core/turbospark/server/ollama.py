"""Ollama's API on the same server: ``/api/chat``, ``/api/generate``, ``/api/embed``
(and the legacy ``/api/embeddings``), ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``.

A chat or generate request is translated into the chat route's own request
and runs through :class:`~turbospark.server.service.Service` as that does (one
decode path, one reuse rule): ``options`` become sampling knobs (the honoured
ones are :data:`HONOURED`; the rest are ignored, as Ollama ignores what a
runner does not use), ``format`` (``"json"`` or a JSON schema) is chat's
``response_format``, ``tools`` are chat's tools, and each reply's tool calls
come back with their arguments as objects. Streaming is Ollama's default:
newline-delimited JSON, one object per piece, the last with ``done: true``
and the timings. ``keep_alive`` maps to the session pool: ``0`` drops the
conversation's session once the reply is sent (memory and disk), a duration
keeps it parked at least that long (the pool evicts every other slot first),
a negative one keeps it for good; left out, the pool's LRU rule alone decides.
Refusals are Ollama's ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbospark.errors import TurbosparkError
from turbospark.generation.generate import Chunk, GenerationStats
from turbospark.generation.logits_processors import REPETITION_PENALTY_RANGE
from turbospark.server import embeddings
from turbospark.server.draws import draws
from turbospark.server.errors import APIError, refusal
from turbospark.server.limits import Deadline, Ticket
from turbospark.server.schemas import (
    ChatCompletionRequest,
    JsonSchemaFormat,
    Message,
    ResponseFormat,
    Text,
    Usage,
)
from turbospark.server.service import EventStream, Service
from turbospark.server.tools import FunctionCall, StreamSplitter, Tool, ToolCall, ToolSyntax

# The Ollama API release whose shapes these routes follow (``/api/version``).
OLLAMA_API_VERSION = "0.12.0"

# Ollama's own defaults for the sampling options (its docs' "Valid Parameters").
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.9
DEFAULT_TOP_K = 40

# The options that change what is generated; every other Ollama option is
# accepted and ignored (num_ctx: the context is the server's --context-length).
HONOURED = (
    "temperature", "top_p", "top_k", "seed", "num_predict", "stop",
    "repeat_penalty", "presence_penalty", "frequency_penalty",
)  # fmt: skip


class Options(BaseModel):
    """``options``: the honoured ones validated, the rest ignored."""

    model_config = ConfigDict(extra="ignore")

    temperature: float = Field(default=DEFAULT_TEMPERATURE, ge=0.0, le=2.0)
    top_p: float = Field(default=DEFAULT_TOP_P, gt=0.0, le=1.0)
    top_k: int = Field(default=DEFAULT_TOP_K, ge=0)
    seed: int | None = Field(default=None, lt=2**64)  # negative: a random seed, as Ollama
    num_predict: int | None = None  # -1: no limit, -2: fill the context (both: until the context)
    stop: list[Text] | None = None
    repeat_penalty: float = Field(
        default=1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)

    @field_validator("num_predict")
    @classmethod
    def _limit(cls, value: int | None) -> int | None:
        if value is not None and value < -2:
            raise ValueError("num_predict must be -1 (no limit), -2 (fill the context) or >= 0")
        return value

    def knobs(self) -> dict[str, Any]:
        """The chat request's fields these options set."""
        limit = self.num_predict if self.num_predict is not None and self.num_predict >= 0 else None
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed if self.seed is not None and self.seed >= 0 else None,
            "max_tokens": limit,
            "stop": self.stop,
            "repetition_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Text
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    function: CallFunction


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: Text | None = None

    @field_validator("images")
    @classmethod
    def _text_only(cls, value: list[Any] | None) -> None:
        if value:
            raise ValueError("images are not supported: this server serves text-only models")
        return None


def _duration(value: float | str | None) -> float | None:
    """``keep_alive`` in seconds (negative: for good), as Ollama reads it: a
    number of seconds, or a Go duration such as ``"5m"`` or ``"1h30m"``."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.fullmatch(r"(-?)((?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+)", text)
    if parts is None:
        raise ValueError(
            f"keep_alive {value!r} is not a duration: send seconds (e.g. 300), a duration "
            "such as '5m' or '1h30m', 0 to drop the session, or -1 to keep it"
        )
    total = sum(
        float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", parts[2])
    )
    return -total if parts[1] else total


def _model_name(value: str) -> str:
    """Ollama's default tag is ``latest``: ``name:latest`` names the served ``name``."""
    return value.removesuffix(":latest")


class GenerationBody(BaseModel):
    """What chat and generate share."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    stream: bool = True
    keep_alive: float | str | None = None
    think: bool | str | None = None

    @field_validator("model")
    @classmethod
    def _tag(cls, value: str) -> str:
        return _model_name(value)

    @field_validator("options", mode="before")
    @classmethod
    def _null_options(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("stream", mode="before")
    @classmethod
    def _null_stream(cls, value: Any) -> Any:
        return True if value is None else value

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float, str, type(None))):
            raise ValueError("keep_alive must be seconds or a duration such as '5m'")
        _duration(value)  # refused here, before any session is touched
        return value

    @field_validator("think")
    @classmethod
    def _no_thinking(cls, value: bool | str | None) -> None:
        if value not in (None, False, ""):
            raise ValueError(
                "think is not supported here: this server does not separate reasoning; "
                "leave it out or send false"
            )
        return None

    @property
    def keep_seconds(self) -> float | None:
        return _duration(self.keep_alive)

    def response_format(self) -> ResponseFormat | None:
        if not self.format:
            return None
        if self.format == "json":
            return ResponseFormat(type="json_object")
        spec = JsonSchemaFormat(name="format", schema=self.format)
        return ResponseFormat(type="json_schema", json_schema=spec)

    def chat_request(
        self, messages: list[Message], tools: list[Tool] | None
    ) -> ChatCompletionRequest:
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            tools=tools or None,
            response_format=self.response_format(),
            **self.options.knobs(),
        )


class ChatBody(GenerationBody):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None

    def chat_messages(self) -> list[Message]:
        """The messages in the chat route's form: an assistant's calls get ids,
        and a tool result is tied to the latest call of its tool."""
        out: list[Message] = []
        calls: list[ToolCall] = []
        for message in self.messages:
            if message.role == "tool":
                call = next(
                    (c for c in reversed(calls) if c.function.name == message.tool_name), None
                )
                out.append(
                    Message(
                        role="tool",
                        content=message.content,
                        tool_call_id=None if call is None else call.id,
                    )
                )
                continue
            made = [
                ToolCall(
                    id=f"call_{uuid.uuid4().hex[:12]}",
                    function=FunctionCall(
                        name=c.function.name, arguments=json.dumps(c.function.arguments)
                    ),
                )
                for c in message.tool_calls or []
            ]
            calls += made
            out.append(Message(role=message.role, content=message.content, tool_calls=made or None))
        return out


class GenerateBody(GenerationBody):
    prompt: Text = ""
    system: Text | None = None
    raw: bool = False
    suffix: Text | None = None
    template: Text | None = None
    context: list[int] | None = None
    images: list[Any] | None = None

    @field_validator("suffix", "template", "context", "images")
    @classmethod
    def _refused(cls, value: Any, info: Any) -> None:
        why = {
            "suffix": "the served families have no fill-in-the-middle tokens",
            "template": "the install's own chat template is used; send raw: true with a "
            "rendered prompt instead",
            "context": "the session pool finds the conversation by its tokens; send the "
            "conversation to /api/chat instead",
            "images": "this server serves text-only models",
        }
        if value:
            raise ValueError(f"'{info.field_name}' is not supported: {why[info.field_name]}")
        return None


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=embeddings.MAX_INPUTS)]
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    keep_alive: float | str | None = None

    @field_validator("model")
    @classmethod
    def _tag(cls, value: str) -> str:
        return _model_name(value)


class LegacyEmbedBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text
    prompt: Text

    @field_validator("model")
    @classmethod
    def _tag(cls, value: str) -> str:
        return _model_name(value)


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text = ""
    name: Text = ""  # the older field name

    @model_validator(mode="after")
    def _asked(self) -> ShowBody:
        if not (self.model or self.name):
            raise ValueError("model is required: send the served model's name")
        self.model = _model_name(self.model or self.name)
        return self


# -- the routes -------------------------------------------------------------------------


def _ollama(handler: Callable[..., Any], model: type[BaseModel]) -> Callable[[Request], Any]:
    """A route: parse *model*, admit, run *handler*; refusals in Ollama's shape."""

    async def route(request: Request) -> Response:
        service: Service = request.app.state.service
        try:
            return await service.run(request, handler, model)
        except APIError as exc:
            return _error(exc)
        except TurbosparkError as exc:
            return _error(refusal(exc, "messages"))

    return route


def _error(exc: APIError) -> Response:
    return JSONResponse(
        {"error": exc.body.error.message}, status_code=exc.status, headers=exc.headers
    )


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _timings(stats: GenerationStats, started: float) -> dict[str, Any]:
    """Ollama's counts and durations (ns), plus usage's ``turbospark`` extension."""
    return {
        "total_duration": int((time.perf_counter() - started) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": stats.prompt_tokens - stats.reused_tokens,
        "prompt_eval_duration": int(stats.prefill_seconds * 1e9),
        "eval_count": stats.generated_tokens,
        "eval_duration": int(stats.decode_seconds * 1e9),
        "turbospark": Usage.from_stats(stats).turbospark.model_dump(),
    }


def _ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = {"arguments": call.function.arguments}
        out.append({"function": {"name": call.function.name, "arguments": arguments}})
    return out


async def _keep_alive(service: Service, seconds: float | None, tokens: list[int]) -> None:
    """Apply ``keep_alive`` to the session holding *tokens* (the conversation
    just answered), on the runner thread between engine steps."""
    if seconds is None:
        return
    store = service.runner.store

    def apply() -> None:
        session = store.holding(tokens)
        if session is None:
            return
        if seconds == 0:
            store.drop(session)
        else:
            store.keep(session, None if seconds < 0 else seconds)

    await asyncio.wrap_future(service.engine.call(apply))


class NdjsonStream(EventStream):
    """Ollama's stream: newline-delimited JSON objects, with the queue place
    held and the generation cancelled as :class:`EventStream` does."""

    media_type = "application/x-ndjson"


async def _run(
    service: Service,
    body: GenerationBody,
    chat: ChatCompletionRequest,
    raw_prompt: str | None,
    deadline: Deadline,
    ticket: Ticket,
    request: Request,
    shape: Callable[[str, list[ToolCall] | None], dict[str, Any]],
) -> Response:
    """Run *chat* (or, with *raw_prompt*, that text as it is) and answer in
    Ollama's shape: *shape* turns a piece of text (and tool calls) into the
    object's payload (``message`` for chat, ``response`` for generate)."""
    started = time.perf_counter()
    syntax: ToolSyntax | None = None
    if raw_prompt is None:
        plan = await service.chat_draws(chat, deadline)
        choices, syntax = plan.draws, plan.syntax
    else:
        ids = await service.prompt_ids(raw_prompt, deadline)
        grammar = await service.response_grammar(chat.response_format, deadline)
        config = chat.generation_config(service.chunk_size, service.default_max_tokens)
        choices = draws(
            [ids], chat, config, vocab_size=service.codec.vocab_size, top_logprobs=None,
            grammar=grammar,
        )  # fmt: skip
    prompt = choices[0].ids
    head = {"model": body.model}
    if not body.stream:
        (done,) = await service.complete(choices, deadline, request)
        text, calls = syntax.parse(done.text) if syntax is not None else (done.text, [])
        await _keep_alive(service, body.keep_seconds, [*prompt, *done.tokens])
        payload = {
            **head,
            "created_at": _now(),
            **shape(text, calls or None),
            "done": True,
            "done_reason": done.finish_reason,
            **_timings(done.stats, started),
        }
        if not isinstance(body, ChatBody):  # generate's (deprecated) context: the ids
            payload["context"] = [*prompt, *done.tokens]
        return JSONResponse(payload)
    events = _stream(
        service, body, service.chunks(choices, deadline), syntax, shape, prompt, started
    )
    return NdjsonStream(events, ticket.hand_over())


async def _stream(
    service: Service,
    body: GenerationBody,
    chunks: AsyncGenerator[tuple[int, Chunk], None],
    syntax: ToolSyntax | None,
    shape: Callable[[str, list[ToolCall] | None], dict[str, Any]],
    prompt: list[int],
    started: float,
) -> AsyncIterator[str]:
    def line(payload: dict[str, Any]) -> str:
        return json.dumps({"model": body.model, "created_at": _now(), **payload}) + "\n"

    splitter = StreamSplitter(syntax) if syntax is not None else None
    tokens: list[int] = []
    try:
        async for _, chunk in chunks:
            if chunk.token is not None:
                tokens.append(chunk.token)
            text = splitter.feed(chunk.text) if splitter is not None else chunk.text
            calls: list[ToolCall] = []
            if chunk.finish_reason is not None and splitter is not None:
                tail, calls = splitter.finish()
                text += tail
            if text or calls:
                yield line({**shape(text, calls or None), "done": False})
            if chunk.finish_reason is None:
                continue
            assert chunk.stats is not None
            await _keep_alive(service, body.keep_seconds, [*prompt, *tokens])
            last = {**shape("", None), "done": True, "done_reason": chunk.finish_reason}
            if not isinstance(body, ChatBody):
                last["context"] = [*prompt, *tokens]
            yield line({**last, **_timings(chunk.stats, started)})
    except APIError as exc:  # the deadline: reported in-band, as Ollama does
        yield json.dumps({"error": exc.body.error.message}) + "\n"
    except TurbosparkError as exc:
        yield json.dumps({"error": refusal(exc, "messages").body.error.message}) + "\n"
    except Exception as exc:  # the headers are sent: report in-band, then end the stream
        yield json.dumps({"error": f"internal error: {type(exc).__name__}: {exc}"}) + "\n"
    finally:
        await chunks.aclose()  # an abandoned stream frees its engine rows now


def _loaded(body: GenerationBody, reason: str) -> Response:
    """A request with nothing to generate: Ollama answers it at once (``load``)."""
    return JSONResponse(
        {"model": body.model, "created_at": _now(), "done": True, "done_reason": reason}
    )


async def _chat(
    service: Service, body: ChatBody, deadline: Deadline, ticket: Ticket, request: Request
) -> Response:
    if not body.messages:
        return _loaded(body, "unload" if body.keep_seconds == 0 else "load")

    def shape(text: str, calls: list[ToolCall] | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = _ollama_calls(calls)
        return {"message": message}

    chat = body.chat_request(body.chat_messages(), body.tools)
    return await _run(service, body, chat, None, deadline, ticket, request, shape)


async def _generate(
    service: Service, body: GenerateBody, deadline: Deadline, ticket: Ticket, request: Request
) -> Response:
    if not body.prompt:
        return _loaded(body, "unload" if body.keep_seconds == 0 else "load")
    messages = [Message(role="system", content=body.system)] if body.system else []
    messages.append(Message(role="user", content=body.prompt))
    chat = body.chat_request(messages, None)

    def shape(text: str, calls: list[ToolCall] | None) -> dict[str, Any]:
        return {"response": text}

    raw = body.prompt if body.raw else None
    return await _run(service, body, chat, raw, deadline, ticket, request, shape)


async def _embed(
    service: Service, body: EmbedBody, deadline: Deadline, ticket: Ticket, request: Request
) -> Response:
    started = time.perf_counter()
    inputs: list[str | list[int]] = (
        [body.input] if isinstance(body.input, str) else list(body.input)
    )
    ids, vectors = await embeddings.embed(service, inputs, deadline, body.dimensions, body.truncate)
    return JSONResponse(
        {
            "model": body.model,
            "embeddings": [v.tolist() for v in vectors],
            "total_duration": int((time.perf_counter() - started) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": sum(len(x) for x in ids),
        }
    )


async def _embeddings(
    service: Service, body: LegacyEmbedBody, deadline: Deadline, ticket: Ticket, request: Request
) -> Response:
    _, (vector,) = await embeddings.embed(service, [body.prompt], deadline, truncate=True)
    return JSONResponse({"embedding": vector.tolist()})


def _details(service: Service) -> dict[str, Any]:
    manifest = service.runner.manifest
    parameters = sum(size for size in _parameter_counts(service))
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": manifest.family,
        "families": [manifest.family],
        "parameter_size": _human(parameters),
        "quantization_level": manifest.dtype,
    }


def _parameter_counts(service: Service) -> list[int]:
    from mlx.utils import tree_flatten

    return [value.size for _, value in tree_flatten(service.runner.model.parameters())]


def _human(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def _card(service: Service) -> dict[str, Any]:
    """The served model as Ollama's model lists show one."""
    manifest = service.runner.manifest
    weights = [manifest.files[name] for name in manifest.weight_files]
    digest = hashlib.sha256("".join(f.sha256 for f in weights).encode()).hexdigest()
    name = service.model_id if ":" in service.model_id else f"{service.model_id}:latest"
    return {
        "name": name,
        "model": name,
        "modified_at": datetime.fromtimestamp(service.created, UTC).isoformat(),
        "size": sum(f.size for f in weights),
        "digest": digest,
        "details": _details(service),
    }


async def tags(request: Request) -> Response:
    return JSONResponse({"models": [_card(request.app.state.service)]})


async def ps(request: Request) -> Response:
    """The served model, always loaded, with the bytes its warm sessions hold."""
    service: Service = request.app.state.service
    card = _card(service)
    held = await asyncio.wrap_future(
        service.engine.call(lambda: sum(service.runner.session_nbytes()))
    )
    size = card["size"] + held
    return JSONResponse(
        {
            "models": [
                {
                    **card,
                    "size": size,
                    "size_vram": size,
                    "expires_at": "2318-01-01T00:00:00Z",  # never unloaded
                    "context_length": service.runner.context_length,
                }
            ]
        }
    )


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_API_VERSION})


async def show(request: Request) -> Response:
    """The served model's details, chat template and capabilities."""
    service: Service = request.app.state.service
    try:
        await service.parse(request, ShowBody, service.deadline(request))
    except APIError as exc:
        return _error(exc)
    runner = service.runner
    family = runner.manifest.family
    template = service.codec.chat_template or ""
    capabilities = ["completion", *(["tools"] if "tools" in template else [])]
    if runner.embeds:
        capabilities.append("embedding")
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": template,
            "details": _details(service),
            "model_info": {
                "general.architecture": family,
                "general.parameter_count": sum(_parameter_counts(service)),
                f"{family}.context_length": runner.context_length,
                f"{family}.embedding_length": runner.arch.hidden_size,
                f"{family}.block_count": runner.arch.num_hidden_layers,
            },
            "capabilities": capabilities,
            "modified_at": _card(service)["modified_at"],
        }
    )


ROUTES = [
    Route("/api/chat", _ollama(_chat, ChatBody), methods=["POST"]),
    Route("/api/generate", _ollama(_generate, GenerateBody), methods=["POST"]),
    Route("/api/embed", _ollama(_embed, EmbedBody), methods=["POST"]),
    Route("/api/embeddings", _ollama(_embeddings, LegacyEmbedBody), methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/version", version, methods=["GET"]),
]
