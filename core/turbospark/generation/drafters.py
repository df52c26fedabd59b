"""Drafters: where speculative tokens come from.

A drafter proposes up to ``depth`` tokens to follow a context (the prompt and
every confirmed token, the last one not fed yet); :mod:`turbospark.generation.speculation`
verifies them against the target in one forward. A drafter may say how sure it
was (``Draft.probs``, one distribution per token, for sampled drafters such as
an MTP head at temperature > 0); without it each token is a point mass, which
is what a deterministic drafter (n-gram lookup, a replay) proposes.

- :class:`NgramDrafter` -- prompt lookup (``DraftPolicies.ngram``).
- :class:`ReplayDrafter` -- proposes a known continuation, right with
  probability ``accuracy`` per token: the oracle the benchmark and the tests
  use to set the acceptance rate (a recorded greedy run replayed is 100%).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from turbospark.errors import InvalidInput

MAX_NGRAM = 4  # the longest suffix prompt lookup tries to match first


@dataclass(frozen=True)
class Draft:
    """Proposed tokens, and the distribution each was drawn from (``(k, vocab)``
    probabilities) when the drafter sampled them; None: point masses."""

    tokens: list[int]
    probs: mx.array | None = None


class Drafter(Protocol):
    """What the speculative loop needs from a source of drafts."""

    @property
    def max_depth(self) -> int:
        """The most tokens one round may propose."""

    @property
    def guesses_ahead(self) -> bool:
        """Whether :meth:`propose_ahead` can propose at all (chained rounds need it)."""

    def propose(self, context: Sequence[int], depth: int) -> Draft:
        """Up to *depth* tokens to follow *context* (empty: nothing worth verifying).
        Contexts of one request only grow, so a drafter may index incrementally."""

    def propose_ahead(self, context: Sequence[int], depth: int) -> Draft:
        """Up to *depth* tokens to follow *context* and then one token not read
        yet (the target's next, still being computed): a chained round verifies
        them behind the round that computes that token, without waiting for it
        (:mod:`turbospark.generation.speculation`). Empty when the drafter cannot guess
        without it."""


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the context's
    last ``n`` tokens (``n`` from ``MAX_NGRAM`` down to ``min_match``) and
    propose what followed it.

    The index maps every n-gram that has a continuation to where it last
    ended, and grows with the context, so a lookup costs a few dict reads
    whatever the context length (a decode step must not scan the history).
    """

    def __init__(self, max_draft: int, min_match: int) -> None:
        if max_draft <= 0 or min_match <= 0:
            raise InvalidInput(
                f"NgramDrafter(max_draft={max_draft}, min_match={min_match}): both must be 1 or more"
            )
        self.max_depth = max_draft
        self.guesses_ahead = True
        self.sizes = list(range(max(min_match, MAX_NGRAM), min_match - 1, -1))
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # n-grams ending before this index are in the index

    def propose(self, context: Sequence[int], depth: int) -> Draft:
        end = len(context) - 1  # the last token: its suffix is what we look up
        for e in range(self._indexed, end):  # n-grams ending at e continue at e + 1
            for n in self.sizes:
                if e + 1 >= n:
                    self._index[n][tuple(context[e + 1 - n : e + 1])] = e
        self._indexed = max(self._indexed, end)
        for n in self.sizes:
            if end + 1 < n:
                continue
            found = self._index[n].get(tuple(context[end + 1 - n :]))
            if found is not None:
                return Draft(list(context[found + 1 : found + 1 + min(depth, self.max_depth)]))
        return Draft([])

    def propose_ahead(self, context: Sequence[int], depth: int) -> Draft:
        """What followed the match, past the token it guesses the unread one is."""
        return Draft(self.propose(context, min(depth, self.max_depth) + 1).tokens[1:])


class ReplayDrafter:
    """Proposes ``reference[len(context):]``, each token right with probability
    *accuracy* (a wrong one is the reference id plus one, modulo the vocabulary).

    With a recorded greedy completion as *reference* and accuracy 1 every draft
    is accepted; with 0 none is: the two ends of the speed-versus-acceptance
    curve, whatever the weights (random weights make real acceptance meaningless).
    """

    def __init__(
        self,
        reference: Sequence[int],
        vocab_size: int,
        max_depth: int,
        accuracy: float = 1.0,
        seed: int = 0,
    ) -> None:
        if max_depth <= 0:
            raise InvalidInput(f"ReplayDrafter(max_depth={max_depth}): use 1 or more")
        if not 0.0 <= accuracy <= 1.0:
            raise InvalidInput(f"ReplayDrafter(accuracy={accuracy}): use a value in [0, 1]")
        self.reference = list(reference)
        self.vocab_size = vocab_size
        self.max_depth = max_depth
        self.guesses_ahead = True
        self.accuracy = accuracy
        self._random = random.Random(seed)

    def propose_ahead(self, context: Sequence[int], depth: int) -> Draft:
        """The reply's tokens after the unread one (its position is all that counts)."""
        return self.propose([*context, 0], depth)

    def propose(self, context: Sequence[int], depth: int) -> Draft:
        start = len(context)
        truth = self.reference[start : start + min(depth, self.max_depth)]
        return Draft(
            [
                t if self._random.random() < self.accuracy else (t + 1) % self.vocab_size
                for t in truth
            ]
        )


def drafter_for(mode: str, max_draft: int, min_match: int) -> Drafter:
    """The drafter a :class:`~turbospark.policies.DraftPolicies` names."""
    if mode == "ngram":
        return NgramDrafter(max_draft, min_match)
    raise InvalidInput(f"no drafter for draft mode {mode!r}; use ngram or off")
