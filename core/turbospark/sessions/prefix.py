"""The prefix record: the token ids a session has actually been fed.

Reuse decisions compare a new prompt against this record, never against what
a caller *says* it sent, so the record is appended only after a call
succeeded. Taint marks a record whose ids cannot prove a match (a failed
call, an active vision map) and is sticky until :meth:`clear`.
"""

from __future__ import annotations

from collections.abc import Sequence


class PrefixRecord:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.tainted = False

    def __len__(self) -> int:
        return len(self.tokens)

    def write(self, position: int, tokens: Sequence[int], *, taint: bool = False) -> None:
        """Record *tokens* fed at *position*: extend at the end, truncate-then-extend
        before it, clear-and-taint past it (a gap means the ids no longer line up)."""
        if position > len(self.tokens):
            self.tokens.clear()
            self.tainted = True
            return
        del self.tokens[position:]
        self.tokens.extend(int(t) for t in tokens)
        self.tainted = self.tainted or taint

    def truncate(self, length: int) -> None:
        del self.tokens[length:]

    def taint(self) -> None:
        self.tainted = True

    def clear(self) -> None:
        self.tokens.clear()
        self.tainted = False

    def common_prefix(self, prompt: Sequence[int]) -> int:
        """Tokens of *prompt* this record can vouch for, leaving at least one
        prompt token to feed (decoding needs fresh logits)."""
        if self.tainted or not self.tokens or not prompt:
            return 0
        limit = min(len(self.tokens), len(prompt) - 1)
        tokens, prompt = self.tokens, list(prompt)
        if tokens[:limit] == prompt[:limit]:  # the common case, compared in C
            return limit
        # Narrow the first mismatch with slice comparisons, then step to it.
        lo, hi = 0, limit
        while hi - lo > 32:
            mid = (lo + hi) // 2
            if tokens[lo:mid] == prompt[lo:mid]:
                lo = mid
            else:
                hi = mid
        while tokens[lo] == prompt[lo]:
            lo += 1
        return lo
