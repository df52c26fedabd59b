"""Choosing the next token from a logits vector.

Every function here stays lazy (returns an ``mx.array``, never a Python int)
so the generation loop can ``mx.async_eval`` the next token while the last
one is detokenised. Randomness comes only from an explicit ``mx.random.key``
threaded through :class:`Sampler`, so a seed reproduces a completion exactly
whatever else the process draws.
"""

from __future__ import annotations

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


class Sampler:
    """Stateful sampler for one request: owns its PRNG key and splits it per token."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = (
            params.seed if params.seed is not None else int(mx.random.randint(0, 2**31 - 1).item())
        )
        self._key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> mx.array:
        """A scalar ``uint32`` token id (lazy) from ``(vocab,)`` float32 logits."""
        p = self.params
        if p.temperature == 0.0:
            return mx.argmax(logits)
        scaled = apply_top_p(apply_top_k(logits / p.temperature, p.top_k), p.top_p)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(scaled, key=sub)
