"""Choosing the next token from a logits vector.

Every function here stays lazy (returns an ``mx.array``, never a Python int)
so the generation loop can ``mx.async_eval`` the next token while the last
one is detokenised. Randomness comes only from an explicit ``mx.random.key``
threaded through :class:`Sampler`, so a seed reproduces a completion exactly
whatever else the process draws.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How to pick tokens. ``temperature == 0`` is greedy (argmax)."""

    model_config = ConfigDict(frozen=True)

    temperature: float = Field(default=0.0, ge=0.0)
    top_k: int = Field(default=0, ge=0, description="keep the k most likely tokens; 0 = all")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus mass; 1 = all")
    seed: int | None = Field(default=None, description="None draws a fresh seed per request")


def apply_top_k(logits: mx.array, k: int) -> mx.array:
    """Mask every logit below the k-th largest to -inf (``logits``: ``(vocab,)``)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    # argpartition puts the k largest in the last k slots (unordered).
    kth = mx.argpartition(logits, kth=-k)[-k]
    return mx.where(logits >= logits[kth], logits, -mx.inf)


def apply_top_p(logits: mx.array, p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose mass reaches *p*."""
    if p >= 1.0:
        return logits
    order = mx.argsort(-logits)  # (vocab,) most likely first
    probs = mx.softmax(logits[order])
    # A token stays if the mass strictly before it is below p, so the top token always stays.
    before = mx.cumsum(probs) - probs
    keep_sorted = before < p
    keep = mx.zeros(logits.shape, mx.bool_)
    keep[order] = keep_sorted
    return mx.where(keep, logits, -mx.inf)


# The log-probability reported for an id the processed logits rule out (a
# grammar's mask): -inf has no JSON form, and a reply that cannot be written
# is a 500. vLLM's OpenAI server reports the same floor.
LOGPROB_FLOOR = -9999.0


def reported_logprobs(logits: mx.array) -> mx.array:
    """Log-softmax over the last axis in float32, floored at :data:`LOGPROB_FLOOR`:
    the values :class:`TokenLogprobs` reports, for one row or several."""
    logits = logits.astype(mx.float32)
    return mx.maximum(logits - mx.logsumexp(logits, axis=-1, keepdims=True), LOGPROB_FLOOR)


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled id's log-probability and the *k* most likely ids' (most likely
    first), from the processed logits before temperature, as OpenAI reports them;
    an id the processed logits rule out reads :data:`LOGPROB_FLOOR`."""

    logprob: float
    top: list[tuple[int, float]]


class Sampler:
    """Stateful sampler for one request: owns its PRNG key and splits it per token.

    *processors* (:mod:`turbospark.generation.logits_processors`) change the logits first,
    in order. With *top_logprobs* set (0 is the sampled id alone) each sample's
    log-probabilities are kept, still lazy, for :meth:`logprobs`.
    """

    def __init__(
        self,
        params: SamplingParams,
        processors: Sequence[object] = (),
        top_logprobs: int | None = None,
    ) -> None:
        self.params = params
        self.processors = list(processors)
        self.top_logprobs = top_logprobs
        # A fresh seed comes from the host, not from MLX's global key: reading an
        # MLX draw (``.item()``) waits for every step queued before it, so each
        # request admitted while others decode would drain the pipeline.
        seed = params.seed if params.seed is not None else secrets.randbelow(2**31 - 1)
        self._key = mx.random.key(seed)
        self._fed: mx.array | None = None
        self._accepted = 0  # samples fed back so far: the index of the next one
        # One per sample: its own lazy arrays, or its row of a batched draw's table.
        self._records: list[tuple[mx.array, mx.array, mx.array] | tuple[LogprobTable, int]] = []

    @property
    def stepwise(self) -> bool:
        """Whether each sample must be drawn alone, a token at a time: processors
        see every sampled id, kept logprobs record every draw (no batched draw,
        no drafted round)."""
        return bool(self.processors) or self.top_logprobs is not None

    @property
    def plain_greedy(self) -> bool:
        """Argmax and nothing else: a batch takes such rows' ids in one op."""
        return self.params.temperature == 0.0 and not self.stepwise

    @property
    def reads_on_host(self) -> bool:
        """Whether sampling may wait on the host (a processor reading the fed id,
        e.g. a grammar), so it is applied after its forward is queued, never
        queued inside it."""
        return bool(self.processors)

    @property
    def plain_random(self) -> bool:
        """Temperature, top-k and top-p and nothing else: a batch samples such
        rows together (:func:`sample_together`), each with its own key."""
        return self.params.temperature > 0.0 and not self.stepwise

    @property
    def keeps_logprobs_only(self) -> bool:
        """Plain sampling that also keeps logprobs: a batch draws such rows with
        the plain ones and computes their logprobs together (:class:`LogprobTable`)."""
        return self.top_logprobs is not None and not self.processors

    def keep(self, table: LogprobTable, row: int) -> None:
        """Record a sample a batch drew for this request (its logprobs are row
        *row* of *table*): the next fed id is counted here, as :meth:`__call__`
        counts it, so a later call alone records at the right index."""
        self._accepted += 1
        del self._records[self._accepted :]
        self._records.append((table, row))

    def unkeep(self) -> None:
        """Undo the last :meth:`keep` (its batched step failed and is retried alone)."""
        self._records.pop()
        self._accepted -= 1

    @property
    def key(self) -> mx.array:
        """The PRNG key the next draw splits: a batch holds it before a step and
        puts it back (:meth:`rewind`) if the step fails after drawing, so the
        retry draws what the failed step drew."""
        return self._key

    def rewind(self, key: mx.array) -> None:
        self._key = key

    def __call__(self, logits: mx.array, fed: mx.array | None = None) -> mx.array:
        """A scalar ``uint32`` token id (lazy) from ``(vocab,)`` float32 logits.

        *fed* is the previous sample, just fed to the model (None for the first
        call, after the prompt). A retried step passes the same array again: the
        processors are told of each fed id once."""
        if fed is not None and fed is not self._fed:
            self._fed = fed
            self._accepted += 1
            for processor in self.processors:
                processor.accept(fed)  # type: ignore[attr-defined]
        for processor in self.processors:
            logits = processor(logits)  # type: ignore[operator]
        token = self._sample(logits)
        if self.top_logprobs is not None:
            del self._records[self._accepted :]
            self._records.append(self._logprobs(logits, token))
        return token

    def _sample(self, logits: mx.array) -> mx.array:
        if self.params.temperature == 0.0:
            return mx.argmax(logits)
        return mx.random.categorical(self.warp(logits), key=self.next_key())

    def warp(self, logits: mx.array) -> mx.array:
        """``(vocab,)`` logits as sampling sees them: temperature, top-k, top-p
        (speculative verification compares drafts against exactly this)."""
        p = self.params
        return apply_top_p(apply_top_k(logits / p.temperature, p.top_k), p.top_p)

    def next_key(self) -> mx.array:
        """A fresh PRNG key from this request's stream."""
        self._key, sub = mx.random.split(self._key)
        return sub

    def _logprobs(self, logits: mx.array, token: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        logprobs = reported_logprobs(logits)
        k = self.top_logprobs or 0
        top = mx.argsort(-logprobs)[:k] if k else mx.zeros((0,), mx.uint32)
        return logprobs[token], top, logprobs[top]

    def logprobs(self, index: int) -> TokenLogprobs | None:
        """The log-probabilities of sample *index* (0 is the first), when kept."""
        if self.top_logprobs is None or index >= len(self._records):
            return None
        record = self._records[index]
        if isinstance(record[0], LogprobTable):
            return record[0].row(record[1], self.top_logprobs)
        chosen, top, values = record
        pairs = list(zip(top.tolist(), values.tolist(), strict=True))
        return TokenLogprobs(logprob=float(chosen.item()), top=pairs)


class LogprobTable:
    """Log-probabilities of several rows' samples from one batched draw, as
    :meth:`Sampler._logprobs` computes them for one row (raw logits, before
    temperature; the *k* most likely, most likely first), in a few ops for all
    rows and read from the device once for all of them, not once per row."""

    def __init__(self, logits: mx.array, tokens: mx.array, k: int) -> None:
        logprobs = reported_logprobs(logits)  # (R, vocab)
        index = tokens.astype(mx.int32)[:, None]
        self.chosen = mx.take_along_axis(logprobs, index, axis=-1)[:, 0]
        self.top = mx.argsort(-logprobs, axis=-1)[:, :k] if k else None
        self.values = None if self.top is None else mx.take_along_axis(logprobs, self.top, axis=-1)
        self._host: tuple[list[float], list[list[int]], list[list[float]]] | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top, self.values) if a is not None]

    def row(self, row: int, k: int) -> TokenLogprobs:
        """Row *row*'s sample and its *k* most likely ids."""
        if self._host is None:
            top = [] if self.top is None else self.top.tolist()
            values = [] if self.values is None else self.values.tolist()
            self._host = (self.chosen.tolist(), top, values)
        chosen, top, values = self._host
        pairs = list(zip(top[row][:k], values[row][:k], strict=True)) if k else []
        return TokenLogprobs(logprob=chosen[row], top=pairs)


_split_keys = mx.vmap(mx.random.split)  # (B, 2) keys -> (B, 2, 2)
_categorical_rows = mx.vmap(lambda key, logits: mx.random.categorical(logits, key=key))


def sample_together(samplers: Sequence[Sampler], logits: mx.array) -> mx.array:
    """One id per row (``(B,)``, lazy) from ``(B, vocab)`` logits for *samplers*
    that are all :attr:`Sampler.plain_random`, in a few ops for the whole
    batch instead of a few per row.

    Each row draws with its own key, split as :meth:`Sampler._sample` splits
    it, and its top-k and top-p cut the same tokens as :func:`apply_top_k` and
    :func:`apply_top_p` (the k-th largest value as the bar; the mass strictly
    before a token below p), so a row samples what it would alone."""
    params = [sampler.params for sampler in samplers]
    vocab = logits.shape[-1]
    scaled = logits / mx.array([p.temperature for p in params])[:, None]
    if any(0 < p.top_k < vocab for p in params):
        ranked = mx.sort(scaled, axis=-1)  # ascending: the k-th largest is at vocab - k
        column = mx.array([vocab - p.top_k if 0 < p.top_k < vocab else 0 for p in params])
        bar = mx.take_along_axis(ranked, column[:, None], axis=-1)  # (B, 1)
        cut = mx.array([0 < p.top_k < vocab for p in params])[:, None]
        scaled = mx.where(cut & (scaled < bar), -mx.inf, scaled)
    if any(p.top_p < 1.0 for p in params):
        order = mx.argsort(-scaled, axis=-1)  # (B, vocab) most likely first
        probs = mx.softmax(mx.take_along_axis(scaled, order, axis=-1), axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs
        mass = mx.array([p.top_p if p.top_p < 1.0 else mx.inf for p in params])[:, None]
        keep = mx.put_along_axis(mx.zeros(scaled.shape, mx.bool_), order, before < mass, axis=-1)
        scaled = mx.where(keep, scaled, -mx.inf)
    keys = _split_keys(mx.stack([sampler._key for sampler in samplers]))  # (B, 2, 2)
    for i, sampler in enumerate(samplers):
        sampler._key = keys[i, 0]
    return _categorical_rows(keys[:, 1], scaled)
