"""Prompt in, tokens out: the generation loop the server, the CLI and the API share.

One request runs the caller contract of SEMANTICS.md, then decodes::

    kept = runner.try_reuse_prefix(prompt)        # swap / rewind, or 0
    if kept == 0:
        runner.reset()                            # park the live session
        kept = runner.share_prefix(prompt)        # a parked conversation's shared opening
    prefill prompt[kept:] from kept in chunks     # logits only for the last chunk
    runner.checkpoint()                           # non-rewindable state at the prompt end
    decode with runner.produce(...)               # until a stop token/string or max_tokens

Decoding is pipelined: the next token is queued with ``mx.async_eval`` before
the last one is detokenised and yielded, so text work and the consumer overlap
the next forward. That forward and its sample are even built from the
still-lazy id and queued together (as mlx-lm's ``generate_step`` does), so
graph building overlaps the previous step's compute and the only host wait
per token is the read of an id already computed; when the id turns out to be a stop, ``runner.take_back()``
undoes the step (non-rewindable state from held references). The last token
of a completion is never fed (nothing would read its logits), so the
session's record ends one token before the reply does and the next turn's
prompt rewinds nothing it does not have to.

With a draft policy (or a *drafter*), a step may instead verify drafts in one
forward and emit several tokens (:mod:`turbospark.generation.speculation`); a round is
committed before any of its tokens is yielded. Until a drafter has been right
(and again after it missed), a drafted step is a shadow probe instead: the same
pipelined plain step, beside which the drafter guesses the token it computes;
the guess is compared with that token when it is read, one step later, so a
drafter that is never right costs no waits and no device work.

A consumer may stop iterating :func:`stream_generate` at any time (a client
that hung up): every yield happens after a finished ``produce`` call, so the
runner's state and its record always agree and the session stays reusable.

Public names:

* :class:`GenerationConfig` -- max tokens, stop strings/ids, chunk size, sampling.
* :func:`stream_generate` -- a generator of :class:`Chunk` (one per token, then a
  final one carrying ``finish_reason`` and :class:`GenerationStats`).
* :func:`generate` -- the same, collected into a :class:`Completion` (:func:`collect`).
* :func:`encode_prompt` / :func:`check_prompt` -- text to ids, and the up-front
  validation that refuses bad input before any session is touched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field

from turbospark.errors import ContextOverflow
from turbospark.generation.drafters import Drafter
from turbospark.generation.runner import Runner
from turbospark.generation.sampling import Sampler, SamplingParams, TokenLogprobs
from turbospark.generation.speculation import Queued, settle, speculation_for
from turbospark.policies.steering import SteeringPolicy
from turbospark.sessions.reuse import ReuseReport
from turbospark.text import StopStrings, TextCodec

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


def stream_generate(
    runner: Runner,
    codec: TextCodec,
    prompt: str | Sequence[int],
    config: GenerationConfig | None = None,
    drafter: Drafter | None = None,
) -> Iterator[Chunk]:
    """Run one request on *runner*, yielding a :class:`Chunk` per generated token
    and a final chunk with the finish reason and stats. See the module docstring.
    *drafter* replaces the runner's draft policy for this request (benchmarks'
    oracles); ``config.draft = False`` turns drafting off."""
    config = config or GenerationConfig()
    ids = encode_prompt(codec, prompt)
    check_prompt(runner, ids)
    stop_ids = frozenset(
        codec.eos_token_ids if config.stop_token_ids is None else config.stop_token_ids
    )
    sampler = Sampler(config)
    generated: list[int] = []
    spec = speculation_for(runner, sampler, ids, generated, enabled=config.draft, drafter=drafter)

    started = time.perf_counter()
    kept, report, evicted = acquire(runner, ids, config.steering)
    logits = _prefill(runner, ids, kept, config.chunk_size)
    runner.checkpoint()
    pending = sampler(logits)
    mx.eval(pending)
    prefilled = time.perf_counter()

    decoder = codec.stream_decoder()
    stops = StopStrings(config.stop)
    limit = config.max_tokens
    position = len(ids)  # where the next generated token is fed
    inflight: Queued | None = None  # a greedy round queued behind the last one, unread
    finish: FinishReason = "length"
    while limit is None or len(generated) < limit:
        remaining = None if limit is None else limit - len(generated)
        depth = 0 if spec is None or spec.probing else spec.plan(position, remaining)
        probe = bool(depth) and spec.shadow  # a plain step, the drafter's guess beside it
        if inflight is not None or (depth and not probe):
            # A drafted round: emit what the target confirmed, then go on from its next
            # token. Greedy rounds are queued (launch) and, while they pass whole, the
            # next is queued behind each before it is read (launch_after).
            verified, queued, ahead = None, inflight, None
            if queued is None:
                tok = int(pending.item())
                if tok in stop_ids:
                    pass  # the plain step below ends the reply
                elif spec.greedy:
                    queued = spec.launch(tok, position, depth)
                else:
                    verified = spec.round(tok, position, depth)
            if queued is not None:
                if spec.chains:
                    ahead = spec.launch_after(queued, remaining)
                verified = spec.resolve(queued)
            inflight = None
            if verified is not None:
                emit, keep = settle(verified.tokens, stop_ids, remaining)
                chunks = []
                for tok in verified.tokens[:emit]:
                    generated.append(tok)
                    chunks.append(Chunk(text=stops.feed(decoder.add(tok)), token=tok))
                    if stops.stopped is not None:
                        break
                stopped = stops.stopped is not None or emit < len(verified.tokens)
                # The round behind this one was fed after all of it: it goes on when
                # all of this one passed, stays fed, and the reply continues.
                goes_on = (
                    ahead is not None
                    and len(verified.tokens) == ahead.position - position
                    and keep == emit == len(verified.tokens)
                    and not stopped
                    and verified.following not in stop_ids
                )
                inflight = ahead if goes_on else None
                if inflight is None and queued is not None:
                    spec.cut(queued, keep)  # before any yield; a round behind it leaves too
                elif queued is None:
                    spec.commit(position, keep)  # before any yield: state and record agree
                try:
                    yield from chunks
                except GeneratorExit:  # the consumer left: no unread round stays fed
                    if inflight is not None:
                        spec.cut(inflight, 0)
                    raise
                if stopped:
                    finish = "stop"
                    break
                if keep < emit:
                    break  # the reply's last token, emitted unfed: "length"
                position += keep
                pending = mx.array(verified.following)
                continue
        more = (limit is None or len(generated) + 1 < limit) and position < runner.context_length
        if more:
            # Build the next forward and its sample from the still-lazy id and
            # queue both, before this token is read and detokenised.
            if probe:
                spec.probe(pending, position)  # compared with `following` once read
            following = runner.produce(pending, position, then=sampler)
        tok = int(pending.item())
        if spec is not None:  # settle the probe that guessed this id; guess after it
            spec.observe(tok, position, ends=tok in stop_ids or not more)
        if tok in stop_ids:
            if more:
                runner.take_back()  # the stop id was fed speculatively
            finish = "stop"
            break
        generated.append(tok)
        if more:
            position += 1
        text = stops.feed(decoder.add(tok))
        if stops.stopped is not None:
            finish = "stop"
            yield Chunk(text=text, token=tok)
            break
        yield Chunk(text=text, token=tok)
        if not more:
            break
        pending = following

    tail = "" if stops.stopped is not None else stops.feed(decoder.flush()) + stops.flush()
    stats = GenerationStats(
        prompt_tokens=len(ids),
        reused_tokens=kept,
        generated_tokens=len(generated),
        reuse_reason=str(report.reason),
        reuse_detail=report.detail,
        swapped=report.swapped,
        evicted=evicted,
        prefill_seconds=prefilled - started,
        decode_seconds=time.perf_counter() - prefilled,
        draft_proposed=0 if spec is None else spec.proposed,
        draft_accepted=0 if spec is None else spec.accepted,
        draft_probed=0 if spec is None else spec.probed,
    )
    yield Chunk(text=tail, finish_reason=finish, stats=stats)


def generate(
    runner: Runner,
    codec: TextCodec,
    prompt: str | Sequence[int],
    config: GenerationConfig | None = None,
    drafter: Drafter | None = None,
) -> Completion:
    """:func:`stream_generate`, collected."""
    return collect(stream_generate(runner, codec, prompt, config, drafter))


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
    nothing. The engine's lone prompts take the same chunks, resumed from any
    of these boundaries, so their state equals this loop's."""
    for begin in range(min(start, length - 1), length, chunk_size):
        yield begin, min(begin + chunk_size, length)


def _prefill(runner: Runner, ids: list[int], start: int, chunk_size: int) -> mx.array:
    """Feed ``ids[start:]`` (:func:`prompt_chunks`); the last token's logits."""
    for begin, end in prompt_chunks(len(ids), start, chunk_size):
        logits = runner.prefill_chunk(ids[begin:end], begin, logits=end == len(ids))
    return logits
