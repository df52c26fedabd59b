"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A request is translated into the chat path's own request (``system`` and the
content blocks into messages, ``tools`` and ``tool_choice`` into OpenAI's, so
the install's template renders them and ``tools.py`` parses the calls back)
and runs through :class:`~turbospark.server.service.Service` as a chat request
does: the same deadline, queue place and engine rows. Replies and refusals
take Anthropic's shapes: ``content`` blocks (``thinking`` when the request
enables it, ``text``, ``tool_use``),
``stop_reason``, SSE events with ``event:`` lines, and errors as
``{"type": "error", "error": {"type", "message"}}``.

``usage.input_tokens`` counts the prompt tokens that were computed and
``cache_read_input_tokens`` the reused prefix (Anthropic's split).
Fields this server cannot honour are refused by name, never ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turbospark.errors import TurbosparkError
from turbospark.generation.generate import Chunk, Completion, GenerationStats
from turbospark.server.errors import APIError, anthropic_error_body, refusal
from turbospark.server.limits import Deadline, Ticket
from turbospark.server.reasoning import Reasoning
from turbospark.server.schemas import (
    ChatCompletionRequest,
    Message,
    Text,
    TextPart,
    TurbosparkOptions,
)
from turbospark.server.service import EventStream, Service
from turbospark.server.tools import (
    FunctionCall,
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    StreamSplitter,
    Tool,
    ToolCall,
    ToolChoice,
    ToolSyntax,
)
from turbospark.text import TextCodec

# Anthropic options this server cannot honour: refused by name, never ignored.
_REFUSED = {
    "mcp_servers": "this server connects to no MCP servers",
    "container": "this server runs no code containers",
    "context_management": "context management is not implemented",
    "output_config": "output configuration (structured outputs, effort) is not implemented",
}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ThinkingBlock(BaseModel):
    """An earlier reply's reasoning, sent back (as the SDK does in a tool loop)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["thinking"]
    thinking: Text
    signature: str | None = None


class ThinkingConfig(BaseModel):
    """``thinking``: on (``enabled``, ``adaptive``) or off. ``budget_tokens`` is
    checked as Anthropic checks it, but the reply's ``max_tokens`` is what bounds
    reasoning and answer together: nothing ends a think block early."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        body = (
            self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        )
        return f"Error: {body}" if self.is_error else body


Block = Annotated[
    TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]
_KINDS = {"text", "thinking", "tool_use", "tool_result"}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: Text | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        """One clear line for an image (document, thinking, ...) block."""
        blocks = data.get("content") if isinstance(data, dict) else None
        for block in blocks if isinstance(blocks, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in _KINDS:
                raise ValueError(
                    f"content blocks of type '{kind}' are not supported: this server serves "
                    f"text-only models; send {sorted(_KINDS)} blocks"
                )
        return data


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["custom"] | None = None  # server tools (bash, web search, ...) are refused
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    input_schema: dict[str, Any]

    def openai(self) -> Tool:
        return Tool(
            type="function",
            function=FunctionDef(
                name=self.name, description=self.description, parameters=self.input_schema
            ),
        )


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' goes with type 'tool', and only with it")
        return self

    def openai(self) -> ToolChoice:
        if self.type == "tool":
            assert self.name is not None
            return NamedToolChoice(type="function", function=FunctionName(name=self.name))
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]  # type: ignore[return-value]


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text
    system: Text | list[TextBlock] | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in _REFUSED.items():
                if data.get(name) not in (None, False, [], {}):
                    raise ValueError(f"'{name}' is not supported: {why}")
        return data

    @property
    def thinks(self) -> bool:
        return self.thinking is not None and self.thinking.on

    def messages_openai(self, results_take_text: bool = False) -> list[Message]:
        """The conversation as chat messages. With *results_take_text* (a template
        that refuses a user message right after tool results, as Gemma's does),
        a user turn's text after its ``tool_result`` blocks joins the last result."""
        out: list[Message] = []
        if self.system:
            system = (
                self.system
                if isinstance(self.system, str)
                else "".join(b.text for b in self.system)
            )
            out.append(Message(role="system", content=system))
        for message in self.messages:
            for each in _openai_messages(message):
                _append(out, each, results_take_text)
        return out

    def chat(self, results_take_text: bool = False, **options: Any) -> ChatCompletionRequest:
        """The same request as the chat path's own; ``thinking`` becomes the
        template's ``enable_thinking`` (off unless enabled, Anthropic's default)."""
        return ChatCompletionRequest(
            model=self.model,
            messages=self.messages_openai(results_take_text),
            tools=[t.openai() for t in self.tools] if self.tools else None,
            tool_choice=self.tool_choice.openai() if self.tool_choice else None,
            chat_template_kwargs={"enable_thinking": self.thinks},
            **options,
        )


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[Text], Field(max_length=16)] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    # turbospark's extensions, as on the OpenAI routes (extra_body).
    turbospark: TurbosparkOptions | None = None
    draft: Literal["on", "off"] = "on"

    @model_validator(mode="after")
    def _budget_within(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(
                f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                f"({self.max_tokens}): the reply's answer comes after its thinking"
            )
        return self

    def chat_request(self, results_take_text: bool = False) -> ChatCompletionRequest:
        return self.chat(
            results_take_text,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            turbospark=self.turbospark,
            draft=self.draft,
        )


def _openai_messages(message: AnthropicMessage) -> list[Message]:
    """One Anthropic turn as chat messages: a user's ``tool_result`` blocks become
    ``tool`` messages, an assistant's ``tool_use`` blocks its ``tool_calls`` and
    its ``thinking`` blocks its ``reasoning_content``."""
    if isinstance(message.content, str):
        return [Message(role=message.role, content=message.content)]
    if message.role == "assistant":
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        thought = "".join(b.thinking for b in message.content if isinstance(b, ThinkingBlock))
        calls = [
            ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
            for b in message.content
            if isinstance(b, ToolUseBlock)
        ]
        return [
            Message(
                role="assistant",
                content=text or None,
                tool_calls=calls or None,
                reasoning_content=thought or None,
            )
        ]
    out: list[Message] = []
    texts: list[TextPart] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            if texts:
                out.append(Message(role="user", content=texts))
                texts = []
            out.append(Message(role="tool", tool_call_id=block.tool_use_id, content=block.text()))
        elif isinstance(block, TextBlock):
            texts.append(TextPart(type="text", text=block.text))
        else:
            kind = "tool_use" if isinstance(block, ToolUseBlock) else block.type
            raise APIError(
                400,
                f"a user turn cannot hold {kind} blocks; send them in an assistant turn",
                param="messages",
            )
    if texts or not out:
        out.append(Message(role="user", content=texts))
    return out


def _text(message: Message) -> str:
    return message.template_dict()["content"]


def _append(out: list[Message], message: Message, results_take_text: bool) -> None:
    """Add *message*, joining it to the one before where a template could not
    render them apart: two user messages in a row (Anthropic allows consecutive
    user turns; alternating templates refuse them) become one, their texts a
    paragraph apart, and with *results_take_text* a user's text right after
    tool results joins the last result."""
    last = out[-1] if out else None
    if last is not None and message.role == "user":
        if last.role == "user":
            out[-1] = Message(role="user", content=_joined(_text(last), _text(message)))
            return
        if last.role == "tool" and results_take_text:
            out[-1] = last.model_copy(update={"content": _joined(_text(last), _text(message))})
            return
    out.append(message)


def _joined(first: str, second: str) -> str:
    return f"{first}\n\n{second}" if first and second else first or second


# -- replies ------------------------------------------------------------------------------


def _usage(stats: GenerationStats) -> dict[str, int]:
    return {
        "input_tokens": stats.prompt_tokens - stats.reused_tokens,
        "output_tokens": stats.generated_tokens,
        "cache_read_input_tokens": stats.reused_tokens,
    }


def _thinking(text: str) -> dict[str, Any]:
    """A thinking block; its signature is empty (Anthropic's verifies its own
    models' reasoning; a local model's has nothing to sign)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.function.name,
        "input": json.loads(call.function.arguments),
    }


def _stop(
    codec: TextCodec, body: MessagesRequest, finish: str, tokens: list[int], called: bool
) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and the ``stop_sequence`` that ended the reply."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if body.stop_sequences and tokens and tokens[-1] not in codec.eos_token_ids:
        full = codec.decode(tokens)
        hits = [s for s in body.stop_sequences if s in full]
        if hits:  # generation stopped at the first match to complete: the one ending last
            return "stop_sequence", max(hits, key=lambda s: full.rfind(s) + len(s))
    return "end_turn", None


def _message(ident: str, model: str, content: list[dict[str, Any]], **rest: Any) -> dict[str, Any]:
    return {"id": ident, "type": "message", "role": "assistant", "model": model,
            "content": content, **rest}  # fmt: skip


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


async def messages(request: Request) -> Response:
    """Refusals take Anthropic's shape from the app's handlers (``errors.py``)."""
    service: Service = request.app.state.service
    return await service.run(request, _messages, MessagesRequest)


async def count_tokens(request: Request) -> Response:
    service: Service = request.app.state.service
    deadline = service.deadline(request)
    body = await service.parse(request, CountTokensRequest, deadline)
    chat = body.chat(not service.user_after_tool_results)
    ids = await service.prompt_ids(
        chat.messages, deadline, chat.tools, chat.chat_template_kwargs, announce=False
    )
    return JSONResponse({"input_tokens": len(ids)})


async def _messages(
    service: Service, body: MessagesRequest, deadline: Deadline, ticket: Ticket, request: Request
) -> Response:
    plan = await service.chat_draws(
        body.chat_request(not service.user_after_tool_results), deadline
    )
    choices, calling = plan.draws, plan.syntax
    reasoning = plan.reasoning if body.thinks else None
    ident = f"msg_{uuid.uuid4().hex}"
    if not body.stream:
        (done,) = await service.complete(choices, deadline, request)
        return JSONResponse(_whole(service, body, ident, done, calling, reasoning))
    chunks = service.chunks(choices, deadline)
    events = _stream(service, body, ident, chunks, calling, reasoning, len(choices[0].ids))
    return EventStream(events, ticket.hand_over())


def _whole(
    service: Service,
    body: MessagesRequest,
    ident: str,
    done: Completion,
    calling: ToolSyntax | None,
    reasoning: Reasoning | None,
) -> dict[str, Any]:
    thought, text = reasoning.split(done.text) if reasoning is not None else (None, done.text)
    prose, calls = calling.parse(text) if calling else (text, [])
    content = (
        ([_thinking(thought)] if thought is not None else [])
        + ([{"type": "text", "text": prose}] if prose or not (calls or thought is not None) else [])
        + [_tool_use(c) for c in calls]
    )
    reason, sequence = _stop(service.codec, body, done.finish_reason, done.tokens, bool(calls))
    return _message(
        ident,
        service.model_id,
        content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=_usage(done.stats),
    )


async def _stream(
    service: Service,
    body: MessagesRequest,
    ident: str,
    chunks: AsyncGenerator[tuple[int, Chunk], None],
    calling: ToolSyntax | None,
    reasoning: Reasoning | None,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    """Anthropic's events: the thinking block's ``thinking_delta`` events and then
    the text block's deltas as they come, each tool call as a ``tool_use`` block
    (its input in one ``input_json_delta``) once the reply ends, then
    ``message_delta`` (stop reason, usage) and ``message_stop``."""
    usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0}
    start = _message(ident, service.model_id, [], stop_reason=None, stop_sequence=None, usage=usage)
    yield _event("message_start", {"message": start})
    splitter = StreamSplitter(calling) if calling else None
    thinking = reasoning.splitter() if reasoning is not None else None
    tokens: list[int] = []
    index, text_open, thought_open = 0, False, False
    try:
        async for _, chunk in chunks:
            if chunk.token is not None:
                tokens.append(chunk.token)
            text, thought = chunk.text, ""
            if thinking is not None:
                thought, text = thinking.take(text, chunk.finish_reason is not None)
            if thought:
                if not thought_open:
                    block = _thinking("")
                    yield _event("content_block_start", {"index": index, "content_block": block})
                    thought_open = True
                delta = {"type": "thinking_delta", "thinking": thought}
                yield _event("content_block_delta", {"index": index, "delta": delta})
            if thought_open and (text or chunk.finish_reason is not None):
                yield _event("content_block_stop", {"index": index})
                index, thought_open = index + 1, False
            text = splitter.feed(text) if splitter is not None else text
            calls: list[ToolCall] = []
            if chunk.finish_reason is not None and splitter is not None:
                tail, calls = splitter.finish()
                text += tail
            # A reply whose text decodes to "" still has its one (empty) text block, as
            # the non-streamed reply does (the SDK's get_final_text() reads it).
            if text or (chunk.finish_reason is not None and not calls and index == 0):
                if not text_open:
                    block = {"type": "text", "text": ""}
                    yield _event("content_block_start", {"index": index, "content_block": block})
                    text_open = True
                if text:
                    delta = {"type": "text_delta", "text": text}
                    yield _event("content_block_delta", {"index": index, "delta": delta})
            if chunk.finish_reason is None:
                continue
            if text_open:
                yield _event("content_block_stop", {"index": index})
                index += 1
            for call in calls:
                block = _tool_use(call)
                arguments = json.dumps(block["input"])
                yield _event(
                    "content_block_start", {"index": index, "content_block": block | {"input": {}}}
                )
                delta = {"type": "input_json_delta", "partial_json": arguments}
                yield _event("content_block_delta", {"index": index, "delta": delta})
                yield _event("content_block_stop", {"index": index})
                index += 1
            assert chunk.stats is not None
            reason, sequence = _stop(service.codec, body, chunk.finish_reason, tokens, bool(calls))
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            yield _event("message_delta", {"delta": delta, "usage": _usage(chunk.stats)})
        yield _event("message_stop", {})
    except APIError as exc:  # the deadline
        yield _event("error", anthropic_error_body(exc))
    except TurbosparkError as exc:
        yield _event("error", anthropic_error_body(refusal(exc, "messages")))
    except Exception as exc:  # the headers are sent: report in-band, then end the stream
        yield _event(
            "error",
            anthropic_error_body(APIError(500, f"internal error: {type(exc).__name__}: {exc}")),
        )
    finally:
        await chunks.aclose()  # an abandoned stream frees its engine rows now
