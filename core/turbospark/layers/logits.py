"""The LM head, applied only where the runner reads logits."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from turbospark.contract.hookspecs import LogitsWanted


def logits_for(
    hidden: mx.array, head: Callable[[mx.array], mx.array], want: LogitsWanted
) -> mx.array | None:
    """float32 logits from final hidden states ``(L, hidden)``: ``(vocab,)`` for
    ``"last"``, ``(L, vocab)`` for ``"all"``, None for ``"none"`` (no head at all:
    a vocab-sized matmul per prompt token is most of a small model's prefill).
    State arrays are not evaluated here: the runner queues them asynchronously."""
    if want == "none":
        return None
    rows = hidden[-1:] if want == "last" else hidden
    out = head(rows).astype(mx.float32)  # (rows, vocab)
    return out.squeeze(0) if want == "last" else out  # a view (out[0] is a gather kernel)


def batch_logits_for(
    hidden: mx.array, head: Callable[[mx.array], mx.array], want: LogitsWanted
) -> mx.array | None:
    """The batched form of :func:`logits_for`: hidden ``(B, L, hidden)`` ->
    ``(B, vocab)`` for ``"last"``, ``(B, L, vocab)`` for ``"all"``, or None."""
    if want == "none":
        return None
    rows = hidden[:, -1] if want == "last" else hidden
    return head(rows).astype(mx.float32)
