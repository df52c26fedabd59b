"""Normalisations shared by families."""

from __future__ import annotations

import mlx.core as mx


def rms_norm_no_scale(x: mx.array, eps: float) -> mx.array:
    """RMSNorm without a learnable scale (Gemma's value norm)."""
    return mx.fast.rms_norm(x, None, eps)
