"""One request's terms: its knobs, its chunks and stats, and the caller contract it starts with.

What the engine (:mod:`turbospark.generation.engine`), the one decode loop,
takes and gives back, and what :mod:`turbospark.generation.generate` and the
server hand it: :class:`GenerationConfig` in, :class:`Chunk` per token out
(the last one with :class:`GenerationStats`); :func:`acquire` runs the caller
contract of SEMANTICS.md; :func:`prompt_chunks` says where a prompt's forwards
begin and end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from turbospark.errors import ContextOverflow
from turbospark.generation.runner import Runner
from turbospark.generation.sampling import SamplingParams, TokenLogprobs
from turbospark.policies.steering import SteeringPolicy
from turbospark.sessions.reuse import ReuseReport
from turbospark.text import TextCodec

FinishReason = Literal["stop", "length"]


class GenerationConfig(SamplingParams):
    """One request's knobs: sampling (inherited), limits and stops."""

    model_config = ConfigDict(frozen=True)

    max_tokens: int | None = Field(
        default=None,
        ge=0,
        description="tokens to generate; None = until a stop or the context ends",
    )
    stop: list[str] = Field(default_factory=list, description="stop strings (not included)")
    stop_token_ids: list[int] | None = Field(
        default=None, description="stop ids; None = the install's eos ids"
    )
    chunk_size: int = Field(default=512, gt=0, description="prefill tokens per forward")
    draft: bool = Field(
        default=True,
        description="use the runner's draft policy (False: this request decodes one token "
        "per forward whatever the policy)",
    )
    steering: SteeringPolicy | None = Field(
        default=None, description="this request's activation steering; None = the runner's"
    )


class GenerationStats(BaseModel):
    """Per-request numbers: what reuse did and how fast each phase ran."""

    prompt_tokens: int
    reused_tokens: int
    generated_tokens: int
    reuse_reason: str
    reuse_detail: str
    swapped: bool
    evicted: bool
    prefill_seconds: float
    decode_seconds: float
    queued_seconds: float = 0.0  # waiting for a batch row (the engine)
    batch_size: int = 1  # the most requests this one decoded beside, itself included
    draft_proposed: int = 0  # speculative tokens verified (turbospark.generation.speculation)
    draft_accepted: int = 0  # of which the target agreed with
    draft_probed: int = 0  # shadow probes: guesses compared with plain steps' tokens

    @property
    def prefill_tokens_per_second(self) -> float:
        fed = self.prompt_tokens - self.reused_tokens
        return fed / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def describe(self) -> str:
        """One line for people: reuse first (the point of this runtime), then speed."""
        moved = ", swapped in a parked session" if self.swapped else ""
        lost = ", evicted a parked session" if self.evicted else ""
        return (
            f"reused {self.reused_tokens}/{self.prompt_tokens} prompt tokens "
            f"({self.reuse_reason}: {self.reuse_detail}{moved}{lost}); "
            f"prefill {self.prefill_seconds * 1e3:.1f} ms "
            f"({self.prefill_tokens_per_second:.0f} tok/s), "
            f"decode {self.generated_tokens} tokens at {self.decode_tokens_per_second:.0f} tok/s"
            + (
                f" (drafts: {self.draft_accepted}/{self.draft_proposed} accepted)"
                if self.draft_proposed
                else ""
            )
        )

    def summary(self) -> dict[str, object]:
        """The stats plus both rates, for JSON output."""
        return {
            **self.model_dump(),
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
        }


@dataclass(frozen=True)
class Chunk:
    """One step of a stream. ``text`` is new, stop-string-safe text (may be
    empty while a partial stop match or an incomplete character is held back).
    The final chunk has ``token=None``, ``finish_reason`` and ``stats``."""

    text: str
    token: int | None = None
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked


def encode_prompt(codec: TextCodec, prompt: str | Sequence[int]) -> list[int]:
    """Ids as given, or a raw text prompt through the tokenizer's own specials
    (e.g. a leading ``<bos>``). Chat prompts come from ``codec.encode_chat``."""
    if isinstance(prompt, str):
        return codec.encode(prompt, add_special_tokens=True)
    return [int(t) for t in prompt]


def check_prompt(runner: Runner, prompt: Sequence[int]) -> None:
    """Refuse a prompt the runner could not take, before reuse or reset touch
    any session (a refusal after ``reset()`` would have parked the live one).
    The length goes first: it is one comparison, the ids are a pass over the prompt."""
    if len(prompt) > runner.context_length:
        raise ContextOverflow(
            f"the prompt is {len(prompt)} tokens but the context length is "
            f"{runner.context_length}; shorten the prompt or serve with a larger --context-length"
        )
    runner.check_ids(prompt)


def acquire(
    runner: Runner, ids: Sequence[int], steering: SteeringPolicy | None = None
) -> tuple[int, ReuseReport, bool]:
    """The caller contract of SEMANTICS.md: make the live session the best one
    for *ids* under *steering* (None: the runner's). Returns the prompt tokens
    already in state, why, and whether a parked session with content was
    discarded on the way."""
    runner.use_steering(steering)  # checked first: a refusal changes nothing
    losses = runner.disk_losses
    kept = runner.try_reuse_prefix(ids)
    report = runner.last_reuse
    # A swap past the byte budget, or parking the live session to share a parked
    # opening, can evict too (see the runner).
    evicted = runner.session_slot_evicted()
    if kept == 0:
        runner.reset()
        evicted = runner.session_slot_evicted()
        kept = runner.share_prefix(ids)
        report = runner.last_reuse if kept else report
    # Writing a session that left memory may push another one's only copy off disk.
    return kept, report, evicted or runner.disk_losses > losses


def collect(chunks: Iterable[Chunk], on_text: Callable[[str], None] | None = None) -> Completion:
    """Gather a stream into a :class:`Completion`, handing each piece of text to
    *on_text* as it arrives (the CLI prints it)."""
    parts: list[str] = []
    tokens: list[int] = []
    logprobs: list[TokenLogprobs] = []
    final = Chunk(text="")
    for final in chunks:
        parts.append(final.text)
        if on_text is not None and final.text:
            on_text(final.text)
        if final.token is not None:
            tokens.append(final.token)
        if final.logprobs is not None:
            logprobs.append(final.logprobs)
    if final.finish_reason is None or final.stats is None:
        raise ValueError("the stream ended without its final chunk")
    return Completion("".join(parts), tokens, final.finish_reason, final.stats, logprobs)


def prompt_chunks(length: int, start: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(begin, end)`` of each forward that feeds a prompt of *length* tokens
    from *start*, at least its last token; the last chunk's last token gives the
    logits. mlx-lm feeds the last token in a forward of its own; on a host-bound
    GPU a forward costs about a decode step whatever its length, and the
    families compute the last chunk's head (and Gemma's KV-shared tail layers,
    which write no state) for its last row only, so one forward fewer costs
    nothing. A prompt prefilled alone takes these chunks, resumed from any of
    these boundaries, so its state is the same however the steps fell."""
    for begin in range(min(start, length - 1), length, chunk_size):
        yield begin, min(begin + chunk_size, length)
