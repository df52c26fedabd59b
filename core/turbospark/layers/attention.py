"""Scaled dot-product attention over a :class:`~turbospark.state.LayerKV`.

Families compute queries/keys/values (with their own norms and RoPE) and call
:func:`cached_attention`; the KV layer decides which rows are retained and
which mask the window implies, so every family gets the same, tested masking.
"""

from __future__ import annotations

import mlx.core as mx

from turbospark.state import LayerKV


def cached_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    kv: LayerKV,
    scale: float,
) -> tuple[mx.array, tuple[mx.array, mx.array, mx.array | str | None]]:
    """Append ``keys``/``values`` (``(1, kv_heads, L, dim)``) to *kv* and attend.

    Returns the output ``(1, heads, L, dim)`` and ``(keys, values, mask)`` as
    attended, so KV-sharing layers can reuse them unchanged.
    """
    keys, values, key_start = kv.update_and_fetch(keys, values)
    mask = kv.mask(queries.shape[2], key_start, keys.shape[2])
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return out, (keys, values, mask)


def shared_attention(
    queries: mx.array, shared: tuple[mx.array, mx.array, mx.array | str | None], scale: float
) -> mx.array:
    """Attend over another layer's ``(keys, values, mask)`` (KV-shared layers)."""
    keys, values, mask = shared
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
