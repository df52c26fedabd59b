"""The gated feed-forward block every family here uses, under HF parameter names."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from turbospark.layers.fused import swiglu
from turbospark.layers.stacked import stacked


class GatedMLP(nn.Module):
    """``down_proj(combine(gate_proj(x), up_proj(x)))``, under those Hugging Face
    names (so a checkpoint's ``mlp.gate_proj.weight`` loads as is): SwiGLU by
    default; Gemma passes its GELU-tanh gate (both one fused kernel,
    :mod:`turbospark.layers.fused`)."""

    def __init__(
        self,
        hidden: int,
        inner: int,
        combine: Callable[[mx.array, mx.array], mx.array] = swiglu,
        bias: bool = False,
    ):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self._combine = combine

    def __call__(self, x: mx.array) -> mx.array:
        pair = stacked(self, ("gate_proj", "up_proj"))  # one matmul for both (unless sharded)
        gate, up = (self.gate_proj(x), self.up_proj(x)) if pair is None else pair(x)
        return self.down_proj(self._combine(gate, up))
