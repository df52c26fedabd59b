"""Query-sparse attention (QSA): which keys each query attends to.

A one-head indexer scores the *complete* blocks of ``block_size`` tokens that
lie before a query's local window (indexer query . mean of the block's index
keys) and keeps the ``top_blocks`` best; the query then attends to those
blocks plus its local window. The local window of position ``p`` starts at
the block boundary at or below ``p + 1 - local_window``, so it always holds
the current (possibly incomplete) block, is disjoint from the candidate
blocks, and the visible set is ``top_blocks`` whole blocks plus one range.

With no more candidate blocks than ``top_blocks`` every candidate is kept and
the query sees every earlier token: exactly dense causal attention. That holds
while ``p + 1 <= top_blocks * block_size + local_window`` (and a little
beyond, until the window's start crosses the next block boundary), and
whenever fewer than ``top_blocks`` blocks are complete.

Prefill applies the selection as a boolean mask, row by row, so each query of
a chunk selects among the blocks complete before it. Decode gathers only the
selected keys, so its cost stops growing with the context once it is sparse.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class QSABudget:
    """The checkpoint's ``qsa_block_size``, ``qsa_top_blocks``, ``qsa_local_window``."""

    block_size: int
    top_blocks: int
    local_window: int

    def local_start(self, position: int) -> int:
        """First token of the local window of the query at *position*."""
        return max(0, (position + 1 - self.local_window) // self.block_size * self.block_size)

    def candidates(self, position: int) -> int:
        """Number of complete blocks before the local window (those the indexer scores)."""
        return self.local_start(position) // self.block_size

    def is_dense(self, position: int) -> bool:
        return self.candidates(position) <= self.top_blocks


def _top_blocks(scores: mx.array, candidates: mx.array, k: int) -> mx.array:
    """``(L, blocks)`` bool: the ``k`` best-scoring blocks among each row's candidates.

    ``scores`` is ``(L, blocks)``; ``candidates`` ``(L,)`` is how many leading
    blocks each row may choose from. No softmax scale: only the ranking matters.
    """
    blocks = scores.shape[1]
    allowed = mx.arange(blocks)[None] < candidates[:, None]  # (L, blocks)
    ranked = mx.argsort(mx.where(allowed, -scores, mx.inf), axis=-1)[:, :k]  # (L, k)
    chosen = mx.put_along_axis(
        mx.zeros(scores.shape, dtype=mx.bool_), ranked, mx.array(True), axis=-1
    )
    return chosen & allowed


def selection_mask(
    index_q: mx.array, pooled: mx.array, start: int, keys: int, budget: QSABudget
) -> mx.array:
    """``(L, keys)`` bool: which of the ``keys`` tokens each query ``start + i`` sees.

    ``index_q`` is ``(L, index_head_dim)``, ``pooled`` ``(blocks, index_head_dim)``
    (every block complete after the chunk; each row only considers its own
    candidates, which are complete before it).
    """
    length = index_q.shape[0]
    size = budget.block_size
    q_pos = mx.arange(start, start + length)  # (L,)
    local = mx.maximum(0, (q_pos + 1 - budget.local_window) // size * size)  # (L,)
    chosen = _top_blocks(index_q @ pooled.T, local // size, budget.top_blocks)  # (L, blocks)
    # (L, blocks) -> (L, blocks * size): a chosen block shows all its tokens
    in_blocks = mx.repeat(chosen, size, axis=1)
    in_blocks = mx.pad(in_blocks, [(0, 0), (0, keys - in_blocks.shape[1])])  # (L, keys)
    k_pos = mx.arange(keys)[None]
    in_window = (k_pos >= local[:, None]) & (k_pos <= q_pos[:, None])
    return in_window | in_blocks


def decode_indices(
    index_q: mx.array, pooled: mx.array, position: int, budget: QSABudget
) -> mx.array:
    """Ascending key positions one sparse decode query attends to: the chosen
    blocks' tokens, then its local window. ``index_q`` is ``(1, index_head_dim)``."""
    size = budget.block_size
    local = budget.local_start(position)
    scores = (index_q @ pooled[: local // size].T)[0]  # (candidates,)
    chosen = mx.sort(mx.argsort(-scores)[: budget.top_blocks])  # (k,) block ids, ascending
    in_blocks = (chosen[:, None] * size + mx.arange(size)[None]).reshape(-1)  # (k * size,)
    return mx.concatenate([in_blocks, mx.arange(local, position + 1)]).astype(mx.int32)


def qsa_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    index_q: mx.array,
    pooled: mx.array,
    start: int,
    budget: QSABudget,
    scale: float,
) -> mx.array:
    """Attention of ``(1, heads, L, dim)`` queries at ``start..`` over every key so
    far (``(1, kv_heads, start + L, dim)``), restricted to each query's selection."""
    length, total = queries.shape[2], keys.shape[2]
    last = start + length - 1
    if budget.is_dense(last):
        # Every row has at most top_blocks candidates: plain causal attention.
        mask = None if length == 1 else "causal"
    elif length == 1:
        picked = decode_indices(index_q, pooled, start, budget)
        keys, values, mask = keys[:, :, picked], values[:, :, picked], None
    else:
        mask = selection_mask(index_q, pooled, start, total, budget)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
