"""OpenAI request and response bodies (the subset turbospark serves), as pydantic models.

Requests ignore fields they do not use (clients send many) but validate every
field they do, so a bad value is a 400 naming the parameter. Responses carry
``usage.prompt_tokens_details.cached_tokens`` (the reused prefix) plus a
``usage.turbospark`` extension with the reuse decision and timings.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from turbospark.generation.generate import FinishReason, GenerationConfig, GenerationStats
from turbospark.generation.logits_processors import REPETITION_PENALTY_RANGE
from turbospark.policies.steering import SteeringPolicy
from turbospark.server.tools import Tool, ToolCall, ToolCallDelta, ToolChoice


def _well_formed(text: str) -> str:
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``); Python decodes
    it into a string no tokenizer or UTF-8 encoder accepts, so it is refused here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X} at character "
            f"{exc.start}); send well-formed Unicode (pair the surrogate or drop it)"
        ) from None
    return text


# Every string the server reads goes through this (ignored extras are never read).
Text = Annotated[str, AfterValidator(_well_formed)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


# Most choices one request may ask for (``n`` times the prompts of a legacy batch):
# each is a row of the engine's batch, so this bounds what one request holds.
MAX_CHOICES = 16


class SteeringOverride(BaseModel):
    """A request's own steering (extension ``"turbospark": {"steering": {...}}``):
    the served vector (``--steering``) under other settings, or ``"mode": "off"``."""

    model_config = ConfigDict(extra="forbid")

    scale: float | None = Field(default=None, allow_inf_nan=False)
    mode: Literal["add", "ablate", "clamp", "renorm", "off"] | None = None
    layers: Annotated[str, Field(pattern=r"^[0-9]{1,4}:[0-9]{1,4}$")] | None = Field(
        default=None, description="S:E, inclusive, llama.cpp's direction numbering"
    )


class TurbosparkOptions(BaseModel):
    """The ``turbospark`` extension object of a request body."""

    model_config = ConfigDict(extra="forbid")

    steering: SteeringOverride | None = None


class BaseRequest(BaseModel):
    """Fields shared by both completion endpoints (OpenAI's names and defaults).

    An explicit ``null`` means the default, as in OpenAI's API (clients send
    ``"temperature": null`` for "unset")."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULLABLE}
        return data

    model: Text
    # At least one: a reply of no tokens is a mistake (as /v1/messages and /v1/responses say).
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="extension: keep the k most likely tokens")
    ignore_eos: bool = Field(
        default=False, description="extension (vLLM's name): generate past the install's eos ids"
    )
    draft: Literal["on", "off"] = Field(
        default="on",
        description="extension: 'off' opts this request out of the server's --draft policy "
        "(one token per forward); 'on' drafts when the server does",
    )
    # What the sampler's PRNG key takes (mx.random.key: an unsigned 64-bit seed).
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="independent completions")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(
        default=1.0,
        ge=REPETITION_PENALTY_RANGE[0],
        le=REPETITION_PENALTY_RANGE[1],
        description="extension (HF/vLLM): divide positive / multiply negative logits of "
        "every id in the prompt or output by this (1: off)",
    )
    # Token id (a JSON object's keys are strings) -> bias added to its logit.
    logit_bias: (
        dict[
            Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]
        ]
        | None
    ) = Field(default=None, max_length=1024)

    turbospark: TurbosparkOptions | None = Field(
        default=None, description="extension: this request's steering (send with extra_body)"
    )

    # OpenAI options this server refuses by name (see _UNIMPLEMENTED), never ignores.
    functions: Any = Field(default=None, exclude=True, description="refused: use tools")
    function_call: Any = Field(default=None, exclude=True, description="refused: use tool_choice")
    audio: Any = Field(default=None, exclude=True, description="refused: text-only models")
    prediction: Any = Field(default=None, exclude=True, description="refused")
    web_search_options: Any = Field(default=None, exclude=True, description="refused")

    @field_validator(*("functions", "function_call", "audio", "prediction", "web_search_options"))
    @classmethod
    def _refuse_unimplemented(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False, [], {}):
            raise ValueError(
                f"'{info.field_name}' is not supported: {_UNIMPLEMENTED[info.field_name]}"
            )
        return None

    @property
    def bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def generation_config(
        self,
        chunk_size: int,
        default_max_tokens: int | None,
        steering: SteeringPolicy | None = None,
    ) -> GenerationConfig:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        requested = self._max_tokens()
        return GenerationConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            max_tokens=default_max_tokens if requested is None else requested,
            chunk_size=chunk_size,
            stop_token_ids=[] if self.ignore_eos else None,
            draft=self.draft == "on",
            steering=steering,
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool result's call
    # An assistant's earlier reasoning (vLLM's field): its template decides whether to keep it.
    reasoning_content: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """One clear line for an image (or audio, file) part, not a union's worth."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"content parts of type '{kind}' are not supported: this server "
                        "serves text-only models; send 'text' parts"
                    )
        return value

    def template_dict(self) -> dict[str, Any]:
        """What the chat template sees: text parts joined, ``developer`` as ``system``."""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content,
        }
        if self.tool_calls:
            out["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Text = "response"
    # The schema itself (JSON Schema): checked by compiling it (logits_processors.py).
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with the schema")
        return self


class ChatCompletionRequest(BaseRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="extension (vLLM's and mlx-lm's): more arguments for the chat template, "
        "e.g. {'enable_thinking': false}",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or {}) & _TEMPLATE_OWN)
        if taken:
            raise ValueError(
                f"may not set {', '.join(map(repr, taken))}: the server renders "
                "it from the request itself (send it as its own field)"
            )
        return value

    @model_validator(mode="after")
    def _logprobs_asked(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def kept_logprobs(self) -> int | None:
        """How many top alternatives each token reports (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def _max_tokens(self) -> int | None:
        # The newer name wins, as in OpenAI's API.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


# What the server passes the chat template itself: a request's template arguments
# cannot replace them.
_TEMPLATE_OWN = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "documents"}
)

TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(BaseRequest):
    # One prompt (text or ids) or a batch of them: each gets its own ``n`` choices.
    prompt: (
        Text
        | TokenIds
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]
    )
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's completions default
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    suffix: Text | None = Field(default=None, description="refused: no family has FIM tokens")

    @field_validator("suffix")
    @classmethod
    def _no_fill_in_the_middle(cls, value: str | None) -> None:
        if value:
            raise ValueError(
                "'suffix' (fill-in-the-middle) is not supported: the served families have "
                "no FIM tokens"
            )
        return None

    @property
    def kept_logprobs(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _choices_fit(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of={self.best_of} with n={self.n} is not supported (no server-side "
                "ranking); leave best_of out or equal to n"
            )
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "echo with logprobs is not supported (prompt tokens get no logprobs); "
                "drop one of them"
            )
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(
                f"{len(self.prompts)} prompts times n={self.n} is {len(self.prompts) * self.n} "
                f"choices; one request may ask for at most {MAX_CHOICES}"
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: a lone prompt is a batch of one."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


# Options OpenAI has that this server refuses (and why), rather than ignore.
_UNIMPLEMENTED = {
    "functions": "use 'tools' (the deprecated 'functions' form is not served)",
    "function_call": "use 'tool_choice' (the deprecated 'function_call' form is not served)",
    "audio": "this server serves text-only models",
    "prediction": "predicted outputs are not implemented",
    "web_search_options": "this server has no web search",
}

# Fields whose explicit null means "the default" (OpenAI's semantics).
_NULLABLE = frozenset(
    {"temperature", "top_p", "top_k", "n", "stream", "ignore_eos", "max_tokens", "draft"}
    | {"presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "echo"}
    | {"best_of"}
)


# -- responses ------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class TurbosparkUsage(BaseModel):
    """Our extension of ``usage``: why the prefix was (not) reused, and timings."""

    reuse_reason: str
    reuse_detail: str
    swapped: bool
    evicted: bool
    prefill_seconds: float
    decode_seconds: float
    prefill_tokens_per_second: float
    decode_tokens_per_second: float
    queued_seconds: float = 0.0
    batch_size: int = 1
    # Prompt tokens computed for this request, over all its choices: with n > 1
    # the prompt is prefilled once, so this is prompt_tokens - cached_tokens.
    prefilled_tokens: int = 0
    draft_proposed: int = 0  # speculative tokens verified (--draft)
    draft_accepted: int = 0  # of which the model agreed with
    draft_probed: int = 0  # shadow probes: guesses compared with plain steps' tokens
    # Window fitting (--context-overflow drop-turns): the oldest messages dropped
    # so the prompt fits, and the prompt tokens they took.
    dropped_messages: int = 0
    dropped_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    turbospark: TurbosparkUsage

    @classmethod
    def of_choices(cls, stats: list[GenerationStats], n: int) -> Usage:
        """One request's usage over its choices: each prompt counts once (the
        first of its *n* choices), every choice's completion counts."""
        first = stats[::n]
        usage = cls.from_stats(stats[0])
        usage.prompt_tokens = sum(s.prompt_tokens for s in first)
        usage.completion_tokens = sum(s.generated_tokens for s in stats)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        usage.prompt_tokens_details.cached_tokens = sum(s.reused_tokens for s in first)
        usage.turbospark.batch_size = max(s.batch_size for s in stats)
        usage.turbospark.prefilled_tokens = sum(s.prompt_tokens - s.reused_tokens for s in stats)
        usage.turbospark.draft_proposed = sum(s.draft_proposed for s in stats)
        usage.turbospark.draft_accepted = sum(s.draft_accepted for s in stats)
        usage.turbospark.draft_probed = sum(s.draft_probed for s in stats)
        return usage

    @classmethod
    def from_stats(cls, stats: GenerationStats) -> Usage:
        return cls(
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.generated_tokens,
            total_tokens=stats.prompt_tokens + stats.generated_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.reused_tokens),
            turbospark=TurbosparkUsage(
                reuse_reason=stats.reuse_reason,
                reuse_detail=stats.reuse_detail,
                swapped=stats.swapped,
                evicted=stats.evicted,
                prefill_seconds=stats.prefill_seconds,
                decode_seconds=stats.decode_seconds,
                prefill_tokens_per_second=stats.prefill_tokens_per_second,
                decode_tokens_per_second=stats.decode_tokens_per_second,
                queued_seconds=stats.queued_seconds,
                batch_size=stats.batch_size,
                prefilled_tokens=stats.prompt_tokens - stats.reused_tokens,
                draft_proposed=stats.draft_proposed,
                draft_accepted=stats.draft_accepted,
                draft_probed=stats.draft_probed,
            ),
        )


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a thinking model's reasoning (vLLM's field)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Chat's ``logprobs``: one entry per generated token."""

    content: list[TokenLogprob]


class TextLogprobs(BaseModel):
    """Legacy completions' ``logprobs`` (parallel lists, one entry per token)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: ChatFinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: ChatFinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: TextLogprobs | None = None


class TextCompletion(_Response):
    """Both the whole ``/v1/completions`` answer and each of its stream chunks."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "turbospark"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str  # authentication_error, invalid_request_error, not_found_error, ...
    message: str


class AnthropicErrorBody(BaseModel):
    """A refusal on Anthropic's routes, in Anthropic's shape (``errors.py``)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
