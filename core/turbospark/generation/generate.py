"""Prompt in, tokens out: one request, for the CLI and the Python API.

:func:`stream_generate` runs one request through an :class:`Engine` with one
row, on the caller's thread: the same admission, prefill and decode steps the
server's engine runs for every request, so there is one decode loop, and the
library, the CLI and the server give the same tokens, stats and reuse reasons
for the same request. One request runs the caller contract of SEMANTICS.md,
then decodes::

    kept = runner.try_reuse_prefix(prompt)        # swap / rewind, or 0
    if kept == 0:
        runner.reset()                            # park the live session
        kept = runner.share_prefix(prompt)        # a parked conversation's shared opening
    prefill prompt[kept:] from kept in chunks     # logits only for the last chunk
    runner.checkpoint()                           # non-rewindable state at the prompt end
    decode, one forward per step                  # until a stop token/string or max_tokens

Decoding is pipelined: the next token is queued before the last one is
detokenised and yielded, so text work and the consumer overlap the next
forward (the engine's module docstring says how). The last token of a
completion is never fed (nothing would read its logits), so the session's
record ends one token before the reply does and the next turn's prompt
rewinds nothing it does not have to.

With a draft policy (or a *drafter*), a step may instead verify drafts in one
forward and emit several tokens (:mod:`turbospark.generation.speculation`); a
round is committed before any of its tokens is yielded.

A consumer may stop iterating :func:`stream_generate` at any time (a client
that hung up): the request is cancelled, and its session is checked back in
as the live one with state and record agreeing, so it stays reusable.

Public names:

* :class:`GenerationConfig` -- max tokens, stop strings/ids, chunk size, sampling.
* :func:`stream_generate` -- a generator of :class:`Chunk` (one per token, then a
  final one carrying ``finish_reason`` and :class:`GenerationStats`).
* :func:`generate` -- the same, collected into a :class:`Completion` (:func:`collect`).
* :func:`encode_prompt` / :func:`check_prompt` -- text to ids, and the up-front
  validation that refuses bad input before any session is touched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from turbospark.generation.drafters import Drafter
from turbospark.generation.engine import Engine
from turbospark.generation.request import (
    Chunk,
    Completion,
    FinishReason,
    GenerationConfig,
    GenerationStats,
    acquire,
    check_prompt,
    collect,
    encode_prompt,
    prompt_chunks,
)
from turbospark.generation.runner import Runner
from turbospark.text import TextCodec

__all__ = [
    "Chunk",
    "Completion",
    "FinishReason",
    "GenerationConfig",
    "GenerationStats",
    "acquire",
    "check_prompt",
    "collect",
    "encode_prompt",
    "generate",
    "prompt_chunks",
    "stream_generate",
]


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
    ids = encode_prompt(codec, prompt)
    # The library's runner writes sessions to its disk tier only as they leave memory.
    engine = Engine(runner, codec, max_batch=1, write_through=False)
    yield from engine.stream(ids, config or GenerationConfig(), drafter)


def generate(
    runner: Runner,
    codec: TextCodec,
    prompt: str | Sequence[int],
    config: GenerationConfig | None = None,
    drafter: Drafter | None = None,
) -> Completion:
    """:func:`stream_generate`, collected."""
    return collect(stream_generate(runner, codec, prompt, config, drafter))
