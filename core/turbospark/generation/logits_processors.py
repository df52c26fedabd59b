"""Per-request logits processors: penalties, ``logit_bias`` and grammar constraints.

A :class:`turbospark.generation.sampling.Sampler` runs its request's processors, in
order, on every logits vector before it samples. Each processor is per row
(one request's state, never shared), so in a batch one request's constraint
or penalty never touches another's row.

The protocol has two calls:

* ``accept(token)`` -- the id just fed to the model (the previous sample),
  still a lazy ``mx.array``. Penalties stay lazy; a grammar reads it (one
  sync for a constrained row only, so unconstrained rows keep the pipeline).
* ``__call__(logits)`` -- ``(vocab,)`` float logits in, the processed ones out.

The grammar constraint is llguidance's: a maintained Rust grammar engine
(JSON schema, Lark, regex) with no Python dependencies, that computes a
token bitmask in microseconds per token, turned here into an ``mx.where``
mask. (Its own MLX helper is a Metal kernel, so it is not used: this runs on
the CPU as well.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import llguidance
import mlx.core as mx
import numpy as np

from turbospark.errors import InvalidInput


class LogitsProcessor(Protocol):
    def accept(self, token: mx.array) -> None: ...

    def __call__(self, logits: mx.array) -> mx.array: ...


class Penalties:
    """OpenAI's presence and frequency penalties over the tokens generated so far
    (the prompt's are not counted): ``logit - presence * [count > 0] - frequency * count``."""

    def __init__(self, presence: float, frequency: float) -> None:
        self.presence = presence
        self.frequency = frequency
        self.counts: mx.array | None = None

    def accept(self, token: mx.array) -> None:
        assert self.counts is not None  # a token is accepted only after a first call
        self.counts = self.counts.at[token.reshape(1)].add(1.0)

    def __call__(self, logits: mx.array) -> mx.array:
        if self.counts is None:
            self.counts = mx.zeros(logits.shape, mx.float32)
        seen = (self.counts > 0).astype(logits.dtype)
        return logits - self.presence * seen - self.frequency * self.counts.astype(logits.dtype)


# A seen id's logit is divided or multiplied by the penalty: past these the
# logits leave float32's range (a penalty of 5e-324 divides by zero), and a
# thousandfold change of a logit already decides every draw.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class RepetitionPenalty:
    """HF's and vLLM's ``repetition_penalty`` over every id already in the prompt
    or the output: a seen id's logit is divided by *penalty* when positive and
    multiplied by it when negative (so ``penalty > 1`` discourages repeats,
    ``< 1`` encourages them, ``1`` does nothing)."""

    def __init__(self, penalty: float, prompt: list[int]) -> None:
        low, high = REPETITION_PENALTY_RANGE
        if not low <= penalty <= high:
            raise InvalidInput(
                f"repetition_penalty must be between {low} and {high} (1: off), got {penalty}"
            )
        self.penalty = penalty
        self.prompt = prompt
        self.seen: mx.array | None = None

    def accept(self, token: mx.array) -> None:
        assert self.seen is not None  # a token is accepted only after a first call
        self.seen = self.seen.at[token.reshape(1)].maximum(mx.array([True]))

    def __call__(self, logits: mx.array) -> mx.array:
        if self.seen is None:
            vocab = logits.shape[-1]
            seen = np.zeros(vocab, np.bool_)
            ids = np.asarray(self.prompt, np.int64)
            seen[ids[(ids >= 0) & (ids < vocab)]] = True
            self.seen = mx.array(seen)
        penalized = mx.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return mx.where(self.seen, penalized, logits)


class LogitBias:
    """OpenAI's ``logit_bias``: a fixed amount added to chosen ids' logits."""

    def __init__(self, bias: Mapping[int, float]) -> None:
        self.bias = dict(bias)
        self.dense: mx.array | None = None

    def accept(self, token: mx.array) -> None:
        pass

    def __call__(self, logits: mx.array) -> mx.array:
        if self.dense is None:
            dense = np.zeros(logits.shape[-1], np.float32)
            for token, value in self.bias.items():
                dense[token] += value
            self.dense = mx.array(dense)
        return logits + self.dense.astype(logits.dtype)


class Grammar:
    """Only the ids the grammar allows next; once it is complete, only an end id.

    *matcher* is a fresh ``llguidance.LLMatcher`` for this request (see
    :class:`GrammarCompiler`)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: mx.array) -> None:
        # A rejected id (impossible under the mask) leaves the matcher in its
        # error state; the mask then allows only an end id, ending the row.
        self.matcher.consume_token(int(token.item()))

    def __call__(self, logits: mx.array) -> mx.array:
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")
        vocab = logits.shape[-1]
        if allowed.size < vocab:  # the model's padded vocabulary past the tokenizer's
            allowed = np.pad(allowed, (0, vocab - allowed.size))
        mask = mx.array(allowed[:vocab].astype(np.bool_))
        return mx.where(mask, logits, -mx.inf)


class GrammarCompiler:
    """One install's llguidance tokenizer, and grammars checked against it.

    Building the tokenizer walks the whole vocabulary (about a second for a
    real one), so one compiler serves every request."""

    def __init__(self, tokenizer_json: str, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=min(eos_token_ids))

    @staticmethod
    def json_schema(schema: Mapping[str, Any] | None) -> str:
        """A grammar for JSON matching *schema* (any JSON object when None),
        written compactly (no free whitespace: a model would loop on it)."""
        body: Mapping[str, Any] = {"type": "object"} if schema is None else schema
        return llguidance.LLMatcher.grammar_from_json_schema(
            dict(body), overrides={"whitespace_flexible": False}
        )

    def check(self, grammar: str, param: str) -> str:
        """*grammar*, or :class:`InvalidInput` naming *param* when it cannot compile."""
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if failed:
            raise InvalidInput(f"{param} cannot be enforced: {messages[0]}")
        return grammar

    def processor(self, grammar: str) -> Grammar:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidInput(f"the grammar cannot be enforced: {matcher.get_error()}")
        return Grammar(matcher)
