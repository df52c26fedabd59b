"""RoPE variants shared by families, as frequency tables for ``mx.fast.rope``."""

from __future__ import annotations

import mlx.core as mx


def rope_freqs(
    dims: int, base: float, rotated_dims: int | None = None, factor: float = 1.0
) -> mx.array:
    """Frequencies for ``mx.fast.rope(..., base=None, freqs=...)``.

    With ``rotated_dims < dims`` this is Gemma's *proportional* partial RoPE:
    exponents are taken over the full head dim and the unrotated pairs get an
    infinite period (frequency 1/inf = 0), so they pass through unchanged.
    """
    rotated = dims if rotated_dims is None else rotated_dims
    exponents = mx.arange(0, rotated, 2, dtype=mx.float32) / dims
    return mx.concatenate([factor * (base**exponents), mx.full(((dims - rotated) // 2,), mx.inf)])


def apply_rope(x: mx.array, offset: int | mx.array, dims: int, freqs: mx.array) -> mx.array:
    """Rotate ``(B, heads, L, head_dim)`` at absolute positions ``offset..``
    (an int, or a ``(B,)`` array: one start per row of a decode batch)."""
    return mx.fast.rope(
        x, dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs
    )
