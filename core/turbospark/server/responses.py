"""OpenAI's Responses API: ``POST /v1/responses``, stateless.

The request (``input`` as a string or items, ``instructions``, function
``tools``) is translated into the chat path's own request and runs through
:class:`~turbospark.server.service.Service` as a chat request does. The reply is a
``response`` object whose ``output`` holds a ``message`` (``output_text``) and
``function_call`` items; streamed, it is the Responses event sequence
(``response.created`` ... ``response.output_text.delta`` ...
``response.completed``). A thinking model's reasoning comes first, as a
``reasoning`` item (streamed as ``response.reasoning_text.delta`` events);
``reasoning.effort: "none"`` turns thinking off in the template. With
``truncation: "auto"`` a conversation past the context loses its oldest turns
(``window.py``). Nothing is stored: ``store: true``,
``previous_response_id`` and the other options that need state are refused
by name, as is anything else this server cannot honour.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turbospark.errors import TurbosparkError
from turbospark.generation.generate import Chunk, GenerationStats
from turbospark.server.errors import APIError, error_json, refusal
from turbospark.server.limits import Deadline, Ticket
from turbospark.server.reasoning import Reasoning
from turbospark.server.schemas import ChatCompletionRequest, Message, Text, TurbosparkOptions
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
    "previous_response_id": "this server stores no responses; resend the conversation",
    "conversation": "this server stores no conversations; resend them",
    "background": "background responses are not implemented",
    "include": "no extra output can be included",
    "prompt": "stored prompts are not implemented",
    "store": "this server stores no responses (send store: false or leave it out)",
}


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


Item = InputMessage | FunctionCallItem | FunctionOutputItem


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
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: ReasoningOptions | None = None
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
        fmt = (data.get("text") or {}).get("format") if isinstance(data.get("text"), dict) else None
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            raise ValueError("'text.format' other than 'text' is not supported here")
        for tool in data.get("tools") or []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tools of type '{kind}' are not supported: send 'function' tools")
        return data

    def chat_request(self) -> ChatCompletionRequest:
        messages: list[Message] = []
        if self.instructions:
            messages.append(Message(role="system", content=self.instructions))
        items = (
            [InputMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        for item in items:
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
            turbospark=self.turbospark,
            draft=self.draft,
            chat_template_kwargs=template_kwargs or None,
        )


def context_overflow(body: ResponsesRequest) -> ContextOverflow:
    """``truncation: "auto"`` drops the oldest turns until the prompt fits
    (``window.py``); ``"disabled"``, OpenAI's default, refuses an overlong one."""
    return "drop-turns" if body.truncation == "auto" else "refuse"


def _usage(stats: GenerationStats, plan: ChatDraws) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.reused_tokens},
        "output_tokens": stats.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }
    if plan.dropped.messages:
        usage["turbospark"] = {
            "dropped_messages": plan.dropped.messages,
            "dropped_tokens": plan.dropped.tokens,
        }
    return usage


def _reasoning_item(ident: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": ident, "summary": [], "content": content, "status": status}


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
        "text": {"format": {"type": "text"}},
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


async def _create(
    service: Service, body: ResponsesRequest, deadline: Deadline, ticket: Ticket, request: Request
) -> Response:
    plan = await service.chat_draws(body.chat_request(), deadline, context_overflow(body))
    choices, calling, reasoning = plan.draws, plan.syntax, plan.reasoning
    ident, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    if not body.stream:
        (done,) = await service.complete(choices, deadline, request)
        thought, text = reasoning.split(done.text) if reasoning else (None, done.text)
        text, calls = calling.parse(text) if calling else (text, [])
        return JSONResponse(
            _response(
                service,
                body,
                ident,
                created,
                output=_output(text, calls, thought),
                usage=_usage(done.stats, plan),
                **_ending(done.finish_reason),
            )
        )
    chunks = service.chunks(choices, deadline)
    events = _stream(service, body, ident, created, chunks, plan, reasoning)
    return EventStream(events, ticket.hand_over())


async def _stream(
    service: Service,
    body: ResponsesRequest,
    ident: str,
    created: int,
    chunks: AsyncGenerator[tuple[int, Chunk], None],
    plan: ChatDraws,
    reasoning: Reasoning | None,
) -> AsyncIterator[str]:
    calling = plan.syntax
    sequence = 0

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
            text, thought = chunk.text, ""
            if thinking is not None:
                thought, text = thinking.feed(text)
                if chunk.finish_reason is not None:
                    more, rest = thinking.finish()
                    thought, text = thought + more, text + rest
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
            final = response | {"output": output, "usage": _usage(chunk.stats, plan)} | ending
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
