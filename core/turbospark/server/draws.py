"""One request's choices as engine rows ("draws"), and their log-probabilities as OpenAI shows them.

A request asks for ``n`` choices of each of its prompts (a legacy batch has
several); each choice is a :class:`Draw`, submitted as its own engine job, so
the choices are rows of one batch. Every draw gets fresh per-row state (its
sampler's key, penalty counts, grammar matcher), so one choice never steers
another. With a seed, choice *j* samples with ``seed + j``: reproducible, and
not n copies of one sample. The draws of one prompt are submitted as one
job and its forks (:func:`leads`), so the prompt is prefilled once and the
other choices start from that state by reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from turbospark.generation.engine import Emit, Job
from turbospark.generation.generate import GenerationConfig
from turbospark.generation.logits_processors import (
    Grammar,
    LogitBias,
    LogitsProcessor,
    Penalties,
    RepetitionPenalty,
)
from turbospark.generation.sampling import TokenLogprobs
from turbospark.server.errors import APIError
from turbospark.server.schemas import (
    BaseRequest,
    ChoiceLogprobs,
    TextLogprobs,
    TokenLogprob,
    TopLogprob,
)
from turbospark.text import TextCodec


@dataclass(eq=False)
class Draw:
    """One choice: prompt ids, knobs, and how to build its per-row processors."""

    ids: list[int]
    config: GenerationConfig
    top_logprobs: int | None = None
    grammar: Callable[[], Grammar] | None = None
    penalties: tuple[float, float] = (0.0, 0.0)
    repetition: float = 1.0  # HF/vLLM's repetition_penalty (1: off)
    bias: dict[int, float] = field(default_factory=dict)
    checkpoint_at: int | None = None  # where the next turn leaves the generation prompt
    prompt_note: str = ""  # how the prompt was built, for the reuse detail (Job.prompt_note)

    def job(self, emit: Emit) -> Job:
        processors: list[LogitsProcessor] = []
        if self.bias:
            processors.append(LogitBias(self.bias))
        if any(self.penalties):
            processors.append(Penalties(*self.penalties))
        if self.repetition != 1.0:
            processors.append(RepetitionPenalty(self.repetition, self.ids))
        if self.grammar is not None:
            processors.append(self.grammar())  # last: nothing may re-allow a masked id
        return Job(
            ids=self.ids,
            config=self.config,
            emit=emit,
            processors=list(processors),
            top_logprobs=self.top_logprobs,
            checkpoint_at=self.checkpoint_at,
            prompt_note=self.prompt_note,
        )


def leads(jobs: list[Job]) -> list[Job]:
    """The jobs to submit: the first job of each distinct prompt, carrying the
    later jobs of that prompt as its ``forks`` (the engine's n > 1 path)."""
    first: dict[tuple[int, ...], Job] = {}
    for job in jobs:
        lead = first.setdefault(tuple(job.ids), job)
        if lead is not job:
            lead.forks.append(job)
    return list(first.values())


def draws(
    prompts: list[list[int]],
    body: BaseRequest,
    config: GenerationConfig,
    *,
    vocab_size: int,
    top_logprobs: int | None,
    grammar: Callable[[], Grammar] | None = None,
) -> list[Draw]:
    """``body.n`` draws per prompt, in OpenAI's choice order (prompt-major)."""
    bias = body.bias
    for token in bias:
        if token >= vocab_size:
            raise APIError(
                400,
                f"logit_bias names token id {token}, but the vocabulary has {vocab_size} ids",
                param="logit_bias",
                code="invalid_value",
            )
    out = []
    for ids in prompts:
        for j in range(body.n):
            seeded = config
            if config.seed is not None and j:
                seeded = config.model_copy(update={"seed": (config.seed + j) % 2**64})
            out.append(
                Draw(
                    ids=ids,
                    config=seeded,
                    top_logprobs=top_logprobs,
                    grammar=grammar,
                    penalties=(body.presence_penalty, body.frequency_penalty),
                    repetition=body.repetition_penalty,
                    bias=bias,
                )
            )
    return out


def _piece(codec: TextCodec, token: int) -> tuple[str, list[int]]:
    text = codec.decode([token], skip_special_tokens=False)
    return text, list(text.encode("utf-8"))


def chat_logprobs(
    codec: TextCodec, tokens: list[int], logprobs: list[TokenLogprobs]
) -> ChoiceLogprobs:
    content = []
    for token, lp in zip(tokens, logprobs, strict=False):
        text, raw = _piece(codec, token)
        top = [TopLogprob(token=t, logprob=v, bytes=b) for (t, b), v in _tops(codec, lp)]
        content.append(TokenLogprob(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
    return ChoiceLogprobs(content=content)


def _tops(codec: TextCodec, lp: TokenLogprobs) -> list[tuple[tuple[str, list[int]], float]]:
    return [(_piece(codec, t), v) for t, v in lp.top]


def text_logprobs(
    codec: TextCodec, tokens: list[int], logprobs: list[TokenLogprobs], offset: int = 0
) -> TextLogprobs:
    out = TextLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token, lp in zip(tokens, logprobs, strict=False):
        text, _ = _piece(codec, token)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({t: v for (t, _), v in _tops(codec, lp)})
        out.text_offset.append(offset)
        offset += len(text)
    return out
