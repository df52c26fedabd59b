"""A session's multi-token-prediction track: the MTP head's K/V and the hidden states it has not read.

It is part of the session (it follows every cut of the record and counts in the
session's bytes); :mod:`turbospark.generation.mtp` is what drafts with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from turbospark.state.kv import KVComponent


@dataclass
class MtpTrack:
    """One session's MTP K/V and the main model's hidden states it has not read yet."""

    cache: KVComponent | None = None
    hidden_start: int = 0  # position of the first row of ``hidden``
    hidden: list[mx.array] = field(default_factory=list)  # (rows, hidden) chunks, contiguous

    @property
    def nbytes(self) -> int:
        """Counted in the session's bytes, so parked sessions' budgets include it."""
        cache = 0 if self.cache is None else self.cache.nbytes
        return cache + sum(chunk.nbytes for chunk in self.hidden)

    def arrays(self) -> list[mx.array]:
        """Every array it holds (the session counts each of its arrays once)."""
        cache = [] if self.cache is None else self.cache.arrays()
        return [*cache, *self.hidden]

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + sum(chunk.shape[0] for chunk in self.hidden)

    def write(self, start: int, hidden: mx.array) -> None:
        """The main model's hidden states ``(L, hidden)`` at ``start ..``."""
        if start != self.hidden_end or not self.hidden:
            if self.hidden and self.hidden_start <= start < self.hidden_end:
                self._truncate_hidden(start)
            else:  # a gap (or nothing yet): the record starts again here
                self.hidden, self.hidden_start = [], start
        self.hidden.append(hidden)

    def cut(self, position: int) -> None:
        """Tokens ``0 .. position-1`` stay in the session; nothing else may remain."""
        self._truncate_hidden(position)
        if self.cache is not None and self.cache.position > position - 1:
            self._rewind_cache(position - 1)

    def reset(self) -> None:
        self.cache, self.hidden, self.hidden_start = None, [], 0

    def rows(self, start: int, end: int) -> mx.array:
        """Hidden states ``[start, end)``, which the record must hold."""
        joined = self.hidden[0] if len(self.hidden) == 1 else mx.concatenate(self.hidden)
        self.hidden = [joined]  # one chunk from now on: the next read slices it
        return joined[start - self.hidden_start : end - self.hidden_start]

    def release(self, before: int) -> None:
        """Forget hidden states before *before* (the cache has read them)."""
        if before <= self.hidden_start or not self.hidden:
            return
        joined = self.rows(self.hidden_start, self.hidden_end)
        self.hidden = [_own(joined[before - self.hidden_start :])]
        self.hidden_start = before

    def _truncate_hidden(self, position: int) -> None:
        if position <= self.hidden_start:
            self.hidden, self.hidden_start = [], position
        elif position < self.hidden_end:
            self.hidden = [_own(self.rows(self.hidden_start, position))]

    def _rewind_cache(self, position: int) -> None:
        assert self.cache is not None
        start = self.cache.position - self.cache.layers[0].fill
        if position <= start:
            self.cache = None  # nothing left: the next draft starts it again
        else:
            self.cache.rewind(self.cache.position - position)


def _own(rows: mx.array) -> mx.array:
    """*rows* (a slice of a joined chunk) copied and queued: a slice kept as
    is would keep the whole chunk alive (a prompt's every hidden state, after
    the first draft read them) while its session sits parked, counted as the
    few rows it shows."""
    copy = mx.contiguous(rows)
    mx.async_eval(copy)
    return copy
