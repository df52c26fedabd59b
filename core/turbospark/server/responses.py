"""OpenAI's Responses API: ``POST /v1/responses``, and its stored responses.

The request (``input`` as a string or items, ``instructions``, function
``tools``, ``text.format``) is translated into the chat path's own request and
runs through :class:`~turbospark.server.service.Service` as a chat request
does; ``text.format`` ``json_schema``/``json_object`` is chat's
``response_format`` (the same constrained decoding). The reply is a
``response`` object whose ``output`` holds a ``message`` (``output_text``) and
``function_call`` items; streamed, it is the Responses event sequence
(``response.created`` ... ``response.output_text.delta`` ...
``response.completed``). A thinking model's reasoning comes first, as a
``reasoning`` item (streamed as ``response.reasoning_text.delta`` events);
``reasoning.effort: "none"`` turns thinking off in the template. With
``truncation: "auto"`` a conversation past the context loses its oldest turns
(``window.py``).

With ``store`` (OpenAI's default) the response's items are kept in the
:class:`~turbospark.server.response_store.ResponseStore`:
``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``
read and drop them, and ``previous_response_id`` continues the conversation:
its items are rendered before the new input, so the pool resumes the
response's own session (reuse reason ``previous_response``) and prefills
only the new turn. When that session has left the pool, the stored items are
prefilled again (``previous_response_evicted``). Options that need state this
server does not keep (``conversation``, ``background``, ...) are refused by name.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turbospark.errors import TurbosparkError
from turbospark.generation.generate import Chunk, GenerationStats
from turbospark.server.errors import APIError, error_json, refusal
from turbospark.server.limits import Deadline, Ticket
from turbospark.server.reasoning import Reasoning
from turbospark.server.response_store import ResponseStore, StoredResponse
from turbospark.server.schemas import (
    ChatCompletionRequest,
    JsonSchemaFormat,
    Message,
    ResponseFormat,
    Text,
    TurbosparkOptions,
    Usage,
)
from turbospark.server.service import ChatDraws, EventStream, Service
from turbospark.server.tools import (
    FunctionCall,
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    StreamSplitter,
    Tool,
    ToolCall,
    ToolChoice,
)
from turbospark.server.window import ContextOverflow

_REFUSED = {
    "conversation": "this server stores no conversations; use previous_response_id or resend them",
    "background": "background responses are not implemented",
    "include": "no extra output can be included",
    "prompt": "stored prompts are not implemented",
}

# The reuse reasons of a continuation (``usage.turbospark.reuse_reason``).
PREVIOUS_RESPONSE = "previous_response"
PREVIOUS_RESPONSE_EVICTED = "previous_response_evicted"


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    def chat(self) -> Message:
        text = (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )
        return Message(role=self.role, content=text)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: Text
    output: Text


class ReasoningItem(BaseModel):
    """A reasoning item sent back (a stored response's, or a client's echo):
    accepted and not rendered, as the template drops an earlier turn's thinking."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]


Item = InputMessage | FunctionCallItem | FunctionOutputItem | ReasoningItem


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: Text


class ReasoningOptions(BaseModel):
    """``reasoning``: ``effort`` "none" turns the template's thinking off; any
    other effort leaves it on (nothing bounds how long a model thinks)."""

    model_config = ConfigDict(extra="ignore")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON matching a schema
    (the Responses API's flat form of chat's ``response_format``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type 'json_schema' needs its 'schema'")
        return self

    def response_format(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        spec = JsonSchemaFormat(
            name=self.name or "response", schema=self.schema_, strict=self.strict
        )
        return ResponseFormat(type="json_schema", json_schema=spec)


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text
    input: Text | Annotated[list[Item], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    text: TextOptions | None = None
    store: bool = True
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: ReasoningOptions | None = None
    previous_response_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")] | None = None
    # turbospark's extensions, as on the chat route (extra_body).
    turbospark: TurbosparkOptions | None = None
    draft: Literal["on", "off"] = "on"
    chat_template_kwargs: dict[str, Any] | None = None  # as on the chat route

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}  # null means the default
        for name, why in _REFUSED.items():
            if data.get(name) not in (None, False, [], {}):
                raise ValueError(f"'{name}' is not supported: {why}")
        for tool in data.get("tools") or []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tools of type '{kind}' are not supported: send 'function' tools")
        return data

    @property
    def items(self) -> list[Item]:
        """This request's input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)

    @property
    def format(self) -> TextFormat:
        return self.text.format if self.text is not None else TextFormat()

    def chat_request(self, prior: list[Item]) -> ChatCompletionRequest:
        """The chat request: the instructions (never carried over from a previous
        response, as in OpenAI's API), the *prior* conversation's items, then this input."""
        messages: list[Message] = []
        if self.instructions:
            messages.append(Message(role="system", content=self.instructions))
        for item in [*prior, *self.items]:
            if isinstance(item, ReasoningItem):
                continue
            if isinstance(item, InputMessage):
                messages.append(item.chat())
            elif isinstance(item, FunctionCallItem):
                call = ToolCall(
                    id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
                )
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant" and last.tool_calls:
                    last.tool_calls.append(call)  # one turn's calls stay one turn
                else:
                    messages.append(Message(role="assistant", tool_calls=[call]))
            else:
                messages.append(
                    Message(role="tool", tool_call_id=item.call_id, content=item.output)
                )
        tools = [
            Tool(type="function", function=FunctionDef(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            ))
            for t in self.tools or []
        ]  # fmt: skip
        choice: ToolChoice | None = None
        if isinstance(self.tool_choice, NamedFunction):
            choice = NamedToolChoice(
                type="function", function=FunctionName(name=self.tool_choice.name)
            )
        else:
            choice = self.tool_choice
        template_kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning is not None and self.reasoning.effort is not None:
            template_kwargs.setdefault("enable_thinking", self.reasoning.effort != "none")
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=tools or None,
            tool_choice=choice,
            response_format=self.format.response_format(),
            turbospark=self.turbospark,
            draft=self.draft,
            chat_template_kwargs=template_kwargs or None,
        )


_ITEMS = TypeAdapter(list[Item])


def stored_item(item: Item) -> dict[str, Any]:
    """An input item as the Responses API lists it (``input_items``): a message's
    content as typed parts, every item with an id."""
    if isinstance(item, InputMessage):
        kind = "output_text" if item.role == "assistant" else "input_text"
        parts = (
            [{"type": kind, "text": item.content}]
            if isinstance(item.content, str)
            else [
                {"type": kind if p.type == "text" else p.type, "text": p.text} for p in item.content
            ]
        )
        return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": item.role,
                "content": parts, "status": "completed"}  # fmt: skip
    if isinstance(item, ReasoningItem):
        return {"id": "rs_" + uuid.uuid4().hex, **item.model_dump(), "status": "completed"}
    prefix = "fc_" if isinstance(item, FunctionCallItem) else "fco_"
    return {"id": prefix + uuid.uuid4().hex, **item.model_dump(), "status": "completed"}


def _usage(stats: GenerationStats, plan: ChatDraws) -> dict[str, Any]:
    # The chat routes' extension: why the prefix was (not) reused, timings, and
    # what window fitting dropped.
    extension = Usage.from_stats(stats).turbospark
    plan.report_dropped(extension)
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.reused_tokens},
        "output_tokens": stats.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "turbospark": extension.model_dump(),
    }


def context_overflow(body: ResponsesRequest) -> ContextOverflow:
    """``truncation: "auto"`` drops the oldest turns until the prompt fits
    (``window.py``); ``"disabled"``, OpenAI's default, refuses an overlong one."""
    return "drop-turns" if body.truncation == "auto" else "refuse"


def _reasoning_item(ident: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": ident, "summary": [], "content": content, "status": status}


class Turn:
    """What one request continues (its previous response, if any) and, once it
    ends, what it stores: the chat request's prompt ids and the output's ids."""

    def __init__(
        self, body: ResponsesRequest, previous: StoredResponse | None, store: ResponseStore
    ) -> None:
        self.body = body
        self.previous = previous
        self.store = store
        self.context = [*(previous.items if previous else []), *map(stored_item, body.items)]

    def stats(self, stats: GenerationStats, prompt: list[int]) -> GenerationStats:
        """*stats* with a continuation's reuse named: its session resumed
        (``previous_response``), or gone from the pool so the stored items were
        prefilled again (``previous_response_evicted``)."""
        if self.previous is None:
            return stats
        held = self.previous.tokens
        shared = next(
            (i for i, (a, b) in enumerate(zip(held, prompt, strict=False)) if a != b),
            min(len(held), len(prompt)),
        )
        ident = self.previous.id
        # A reply's last token is sampled, never fed: the session holds one token less.
        if stats.reused_tokens >= shared - 1 and stats.reused_tokens > 0:
            reason = PREVIOUS_RESPONSE
            detail = (
                f"continued the session of {ident}: {stats.reused_tokens} token(s) kept "
                f"({stats.reuse_reason}: {stats.reuse_detail}); only the new turn was prefilled"
            )
        else:
            reason = PREVIOUS_RESPONSE_EVICTED
            detail = (
                f"the session of {ident} ({shared} token(s) of this prompt) is no longer warm "
                "(evicted from the session pool); its stored items were prefilled again "
                f"({stats.reuse_reason}: {stats.reuse_detail})"
            )
        return stats.model_copy(update={"reuse_reason": reason, "reuse_detail": detail})

    def keep(self, response: dict[str, Any], prompt: list[int], output: list[int]) -> None:
        if self.body.store:
            self.store.put(
                StoredResponse(
                    id=response["id"],
                    created_at=time.time(),
                    response=response,
                    context=self.context,
                    tokens=[*prompt, *output],
                )
            )


def _text_item(ident: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": ident, "status": status, "role": "assistant",
            "content": [part] if status == "completed" else []}  # fmt: skip


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + uuid.uuid4().hex,
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments,
        "status": "completed",
    }


def _output(text: str, calls: list[ToolCall], thought: str | None) -> list[dict[str, Any]]:
    items = [_reasoning_item("rs_" + uuid.uuid4().hex, thought)] if thought is not None else []
    if text or not (calls or items):
        items.append(_text_item("msg_" + uuid.uuid4().hex, text))
    return items + [_call_item(c) for c in calls]


def _response(
    service: Service, body: ResponsesRequest, ident: str, created: int, **rest: Any
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "response",
        "created_at": created,
        "model": service.model_id,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [t.model_dump() for t in body.tools or []],
        "tool_choice": body.tool_choice.model_dump()
        if isinstance(body.tool_choice, NamedFunction)
        else body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "metadata": body.metadata or {},
        "text": {"format": body.format.model_dump(by_alias=True, exclude_none=True)},
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "truncation": body.truncation,
        "error": None,
        "incomplete_details": None,
        "output": [],
        "usage": None,
        "status": "in_progress",
        **rest,
    }


def _ending(finish: str) -> dict[str, Any]:
    if finish == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed"}


async def create(request: Request) -> Response:
    service: Service = request.app.state.service
    return await service.run(request, _create, ResponsesRequest)


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _stored(request: Request, ident: str, param: str | None = None) -> StoredResponse:
    """The stored response *ident*, or a 404 naming it and why it is gone."""
    entry = _store(request).get(ident)
    if entry is not None:
        return entry
    why = _store(request).why_gone(ident) or (
        "it was never stored here (store: false, another server) or was deleted"
    )
    raise APIError(
        404,
        f"the response '{ident}' was not found: {why}; resend the conversation as input instead",
        param=param,
        code="response_not_found",
    )


async def _create(
    service: Service, body: ResponsesRequest, deadline: Deadline, ticket: Ticket, request: Request
) -> Response:
    previous = None
    prior: list[Item] = []
    if body.previous_response_id is not None:
        previous = _stored(request, body.previous_response_id, "previous_response_id")
        try:
            prior = _ITEMS.validate_python(previous.items)
        except ValidationError as exc:  # an item shape this server cannot render back
            raise APIError(
                400,
                f"the response '{previous.id}' holds items this server cannot continue: {exc}",
                param="previous_response_id",
                code="invalid_value",
            ) from None
    turn = Turn(body, previous, _store(request))
    plan = await service.chat_draws(body.chat_request(prior), deadline, context_overflow(body))
    choices, calling, reasoning = plan.draws, plan.syntax, plan.reasoning
    ident, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    prompt = choices[0].ids
    if not body.stream:
        (done,) = await service.complete(choices, deadline, request)
        thought, text = reasoning.split(done.text) if reasoning else (None, done.text)
        text, calls = calling.parse(text) if calling else (text, [])
        response = _response(
            service,
            body,
            ident,
            created,
            output=_output(text, calls, thought),
            usage=_usage(turn.stats(done.stats, prompt), plan),
            **_ending(done.finish_reason),
        )
        turn.keep(response, prompt, done.tokens)
        return JSONResponse(response)
    chunks = service.chunks(choices, deadline)
    events = _stream(service, body, ident, created, chunks, plan, reasoning, turn, prompt)
    return EventStream(events, ticket.hand_over())


async def retrieve(request: Request) -> Response:
    return JSONResponse(_stored(request, request.path_params["response_id"]).response)


async def delete(request: Request) -> Response:
    ident = request.path_params["response_id"]
    if not _store(request).delete(ident):
        _stored(request, ident)  # the 404, with why
    return JSONResponse({"id": ident, "object": "response", "deleted": True})


async def input_items(request: Request) -> Response:
    """``GET /v1/responses/{id}/input_items``: the conversation before the
    response's output (``order``, ``limit`` and ``after`` as OpenAI pages them)."""
    entry = _stored(request, request.path_params["response_id"])
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got '{order}'", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be an integer from 1 to 100", param="limit")
    items = entry.context if order == "asc" else entry.context[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(400, f"after names no item of '{entry.id}': {after}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


async def _stream(
    service: Service,
    body: ResponsesRequest,
    ident: str,
    created: int,
    chunks: AsyncGenerator[tuple[int, Chunk], None],
    plan: ChatDraws,
    reasoning: Reasoning | None,
    turn: Turn,
    prompt: list[int],
) -> AsyncIterator[str]:
    calling = plan.syntax
    sequence = 0
    tokens: list[int] = []

    def event(kind: str, **payload: Any) -> str:
        nonlocal sequence
        sequence += 1
        data = {"type": kind, "sequence_number": sequence - 1, **payload}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    response = _response(service, body, ident, created)
    yield event("response.created", response=response)
    yield event("response.in_progress", response=response)
    splitter = StreamSplitter(calling) if calling else None
    thinking = reasoning.splitter() if reasoning is not None else None
    message_id, reasoning_id = "msg_" + uuid.uuid4().hex, "rs_" + uuid.uuid4().hex
    opened, text_all, thinking_open, thought_all = False, "", False, ""
    output: list[dict[str, Any]] = []  # the items done
    try:
        async for _, chunk in chunks:
            if chunk.token is not None:
                tokens.append(chunk.token)
            text, thought = chunk.text, ""
            if thinking is not None:
                thought, text = thinking.take(text, chunk.finish_reason is not None)
            if thought:
                if not thinking_open:
                    thinking_open = True
                    item = _reasoning_item(reasoning_id, "", "in_progress")
                    yield event("response.output_item.added", output_index=0, item=item)
                thought_all += thought
                yield event(
                    "response.reasoning_text.delta",
                    item_id=reasoning_id,
                    output_index=0,
                    content_index=0,
                    delta=thought,
                )
            if thinking_open and (text or chunk.finish_reason is not None):
                thinking_open = False
                yield event(
                    "response.reasoning_text.done",
                    item_id=reasoning_id,
                    output_index=0,
                    content_index=0,
                    text=thought_all,
                )
                item = _reasoning_item(reasoning_id, thought_all)
                yield event("response.output_item.done", output_index=0, item=item)
                output.append(item)
            at = len(output)  # the message's index: after the reasoning item, if any
            text = splitter.feed(text) if splitter is not None else text
            calls: list[ToolCall] = []
            if chunk.finish_reason is not None and splitter is not None:
                tail, calls = splitter.finish()
                text += tail
            ends_bare = chunk.finish_reason is not None and not (calls or output)
            if (text or ends_bare) and not opened:
                opened = True
                item = _text_item(message_id, "", "in_progress")
                yield event("response.output_item.added", output_index=at, item=item)
                part = {"type": "output_text", "text": "", "annotations": []}
                yield event(
                    "response.content_part.added",
                    item_id=message_id,
                    output_index=at,
                    content_index=0,
                    part=part,
                )
            if text:
                text_all += text
                yield event(
                    "response.output_text.delta",
                    item_id=message_id,
                    output_index=at,
                    content_index=0,
                    delta=text,
                )
            if chunk.finish_reason is None:
                continue
            if opened:
                part = {"type": "output_text", "text": text_all, "annotations": []}
                yield event(
                    "response.output_text.done",
                    item_id=message_id,
                    output_index=at,
                    content_index=0,
                    text=text_all,
                )
                yield event(
                    "response.content_part.done",
                    item_id=message_id,
                    output_index=at,
                    content_index=0,
                    part=part,
                )
                item = _text_item(message_id, text_all)
                yield event("response.output_item.done", output_index=at, item=item)
                output.append(item)
            for call in calls:
                item = _call_item(call)
                at = len(output)
                yield event(
                    "response.output_item.added",
                    output_index=at,
                    item=item | {"arguments": "", "status": "in_progress"},
                )
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=at,
                    delta=item["arguments"],
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=at,
                    arguments=item["arguments"],
                )
                yield event("response.output_item.done", output_index=at, item=item)
                output.append(item)
            assert chunk.stats is not None
            ending = _ending(chunk.finish_reason)
            usage = _usage(turn.stats(chunk.stats, prompt), plan)
            final = response | {"output": output, "usage": usage} | ending
            turn.keep(final, prompt, tokens)
            kind = (
                "response.completed" if ending["status"] == "completed" else "response.incomplete"
            )
            yield event(kind, response=final)
    except APIError as exc:  # the deadline
        yield event("error", **json.loads(error_json(exc.body))["error"])
    except TurbosparkError as exc:
        yield event("error", **json.loads(error_json(refusal(exc, "input").body))["error"])
    except Exception as exc:  # the headers are sent: report in-band, then end the stream
        failure = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        yield event("error", **json.loads(error_json(failure.body))["error"])
    finally:
        await chunks.aclose()  # an abandoned stream frees its engine rows now
