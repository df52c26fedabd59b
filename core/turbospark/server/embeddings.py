"""OpenAI's ``POST /v1/embeddings``: each input's final hidden states, mean-pooled
and L2-normalized (:meth:`turbospark.generation.runner.Runner.embed`).

An embedding runs on the runner thread between two engine steps, in a
throwaway state: no session, live or parked, is read or changed, so an
embedding request never costs a conversation its reuse. A family without the
``turbospark_forward_hidden`` hook is refused by name. ``encoding_format``
``base64`` (the ``openai`` SDK's default) is little-endian float32, as OpenAI's.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turbospark.errors import TurbosparkError
from turbospark.generation.generate import encode_prompt
from turbospark.server.errors import APIError, refusal
from turbospark.server.limits import Deadline, Ticket
from turbospark.server.schemas import Text
from turbospark.server.service import Service

# Inputs one request may embed: each is a forward over up to the context length.
MAX_INPUTS = 256

TokenIds = list[Annotated[int, Field(ge=0)]]


class EmbeddingRequest(BaseModel):
    """OpenAI's request: one text, texts, token ids, or lists of token ids."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    input: Text | list[Text] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        default=None, ge=1, description="must be the model's hidden size, or unset"
    )
    user: Text | None = None

    @field_validator("input")
    @classmethod
    def _bounded(cls, value: object) -> object:
        """One clear line for an empty or oversized batch (the union's own errors are four)."""
        if isinstance(value, list) and not value:
            raise ValueError("input is an empty list; send a text, texts, or token ids")
        batch = isinstance(value, list) and isinstance(value[0], (str, list))
        if batch and len(value) > MAX_INPUTS:  # type: ignore[arg-type]
            raise ValueError(f"input holds {len(value)} items; at most {MAX_INPUTS} a request")  # type: ignore[arg-type]
        return value

    @property
    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]  # type: ignore[list-item]
        return list(self.input)  # type: ignore[arg-type]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


async def create(request: Request) -> Response:
    service: Service = request.app.state.service
    return await service.run(request, _create, EmbeddingRequest)


async def _create(
    service: Service, body: EmbeddingRequest, deadline: Deadline, ticket: Ticket, request: Request
) -> Response:
    ids, vectors = await embed(service, body.inputs, deadline, body.dimensions)
    data = [
        Embedding(index=i, embedding=_encoded(v, body.encoding_format))
        for i, v in enumerate(vectors)
    ]
    total = sum(len(x) for x in ids)
    reply = EmbeddingList(
        data=data,
        model=service.model_id,
        usage=EmbeddingUsage(prompt_tokens=total, total_tokens=total),
    )
    return JSONResponse(reply.model_dump())


async def embed(
    service: Service,
    inputs: list[str | list[int]],
    deadline: Deadline,
    dimensions: int | None = None,
    truncate: bool = False,
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Each input's ids and pooled vector (OpenAI's and Ollama's routes), every
    input checked first; with *truncate* (Ollama's default) an input longer
    than the context keeps its first tokens instead of being refused."""
    runner = service.runner
    if runner.group is not None:
        raise APIError(
            400,
            "embeddings are not served under --distributed (they run outside the ranks' "
            "lockstep); serve embeddings from a single-process replica",
            param="model",
            code="unsupported",
        )
    if not runner.embeds:
        raise APIError(
            400,
            f"this install's family ({runner.family.name}) gives no hidden states, so it cannot "
            "serve embeddings",
            param="model",
            code="unsupported",
        )
    hidden = runner.arch.hidden_size
    if dimensions is not None and dimensions != hidden:
        raise APIError(
            400,
            f"dimensions must be this model's hidden size, {hidden} (or unset); got {dimensions}",
            param="dimensions",
            code="invalid_value",
        )
    tokenize = functools.partial(_ids, service, inputs, truncate)
    ids = await deadline.run(
        asyncio.get_running_loop().run_in_executor(service.text_pool, tokenize),
        "while the input was tokenized",
    )
    work = functools.partial(_embed, service, ids)
    vectors = await deadline.run(asyncio.wrap_future(service.engine.call(work)), "while embedding")
    return ids, vectors


def _ids(service: Service, inputs: list[str | list[int]], truncate: bool) -> list[list[int]]:
    """Each input's ids, checked (length, vocabulary) before the runner sees any."""
    out = []
    for i, item in enumerate(inputs):
        param = "input" if len(inputs) == 1 else f"input.{i}"
        if isinstance(item, str) and not item:
            raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
        ids = encode_prompt(service.codec, item)
        if truncate:
            ids = ids[: service.runner.context_length]
        try:
            service.runner.check_ids(ids)
        except TurbosparkError as exc:
            raise refusal(exc, param) from exc
        if len(ids) > service.runner.context_length:
            raise APIError(
                400,
                f"{param} is {len(ids)} tokens but the context length is "
                f"{service.runner.context_length}; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        out.append(ids)
    return out


def _embed(service: Service, ids: list[list[int]]) -> list[np.ndarray]:
    """On the runner thread (between engine steps): one pooled vector per input."""
    return [np.array(service.runner.embed(x, service.chunk_size), dtype=np.float32) for x in ids]


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
