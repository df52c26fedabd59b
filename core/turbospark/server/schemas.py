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

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from turbospark.generate import FinishReason, GenerationConfig, GenerationStats


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


class BaseRequest(BaseModel):
    """Fields shared by both completion endpoints (OpenAI's names and defaults)."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="extension: keep the k most likely tokens")
    ignore_eos: bool = Field(
        default=False, description="extension (vLLM's name): generate past the install's eos ids"
    )
    # What the sampler's PRNG key takes (mx.random.key: an unsigned 64-bit seed).
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1

    def generation_config(
        self, chunk_size: int, default_max_tokens: int | None
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

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None

    def template_dict(self) -> dict[str, str]:
        """What the chat template sees: text parts joined, ``developer`` as ``system``."""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(BaseRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=0)

    def _max_tokens(self) -> int | None:
        # The newer name wins, as in OpenAI's API.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(BaseRequest):
    prompt: Text | Annotated[list[int], Field(min_length=1)]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's completions default

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        # A one-element batch is the same request; real batches are refused.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            return value[0]
        return value


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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    turbospark: TurbosparkUsage

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
            ),
        )


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


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
