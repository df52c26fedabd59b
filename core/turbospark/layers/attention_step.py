"""A self-attention layer's decode step as one traced call, where the attention kernels run.

A lone row's decode step on a GPU is bound by the host (see
:mod:`turbospark.layers.layer_step`). Run as one traced call, a self-attention
layer is its input norm, its projections as one matmul, the heads' own
math (norms on q and k, RoPE, an output gate: the architecture's), the new
key and value written into the cache's buffers on the device, the attention
kernels over the rows attended, the output gate, the output projection and
the layer's end (:func:`~turbospark.layers.layer_end.step_end`). A layer that
shares another's K/V writes nothing: its queries attend over the rows that
layer attended.

A family states what differs as an :class:`AttentionStep`: the function from
the projected row to the heads (its ``inputs``, which its modules' path
computes too), the weights it reads and the paths to them; the block takes
the kernels, claims the rows, keeps the weights and falls back (returns
None) where the kernels do not take the layer. The queries come scaled (the
architecture folds the attention's scale into its query norm).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from turbospark.layers.attention import Attended
from turbospark.layers.cuda.norm import Unjoined
from turbospark.layers.fused import sigmoid_gate
from turbospark.layers.layer_end import EndWeights, LayerEnd, step_end
from turbospark.layers.layer_step import (
    Stream,
    attend,
    cache_step,
    flat,
    kernel_cache,
    kernel_rows,
    kernels_take,
    lifted,
    normed_stream,
    stream_of,
    written,
)
from turbospark.layers.stacked import matmul_t

# What a step's attention reads (AttentionStep.weights): its projections as
# one matrix, transposed (or packed: turbospark.layers.stacked.WeightT); what
# its inputs function reads besides (its norms' weights, RoPE's frequencies);
# the output projection, alike.
MixerWeights = tuple[Any, ...]
# A step's weights: the input norm's, the attention's and the layer end's
# (LayerEnd.step_weights).
StepWeights = tuple[mx.array, MixerWeights, EndWeights]
# (projected, what it reads, start, *args) -> (queries, keys, values, gate):
# the heads ``(1, n, 1, D)`` from the projected row ``(1, width)``; keys and
# values None for a layer that shares its K/V, gate None where there is none.
Inputs = Callable[..., tuple[mx.array | None, ...]]


def _mixed(
    inputs: Inputs, weights: StepWeights, stream: Stream, start: mx.array, args: tuple, eps: float
) -> tuple[mx.array, tuple[mx.array | None, ...]]:
    """The joined stream and the heads (:data:`Inputs`) of the normed row."""
    input_w, (in_t, *reads, _), _ = weights
    h, x = normed_stream(stream, input_w, eps)
    return h, inputs(matmul_t(x, in_t), tuple(reads), start, *args)


def _ended(
    h: mx.array,
    out: mx.array,
    gate: mx.array | None,
    weights: StepWeights,
    side_input: mx.array | None,
    by_kernel: bool,
    eps: float,
    gelu: bool,
) -> tuple[mx.array, ...]:
    """The attention's output *out* gated (where there is a gate), then the
    output projection and the layer's end, ``(1, 1, hidden)`` each."""
    if gate is not None:
        out = sigmoid_gate(out, gate)
    end = weights[2]
    return lifted(step_end(h, flat(out), weights[1][-1], side_input, end, by_kernel, eps, gelu))


def owner_layer(
    inputs: Inputs,
    stream: Stream,
    weights: StepWeights,
    start: mx.array,
    keys: mx.array,
    values: mx.array,
    rows: mx.array,
    row: mx.array,
    side_input: mx.array | None,
    args: tuple,
    by_kernel: bool,
    eps: float,
    gelu: bool,
) -> tuple[mx.array, ...]:
    """A K/V-owning layer's whole decode step: the heads (*inputs*, RoPE from
    *start*), the new key and value written into the buffers *keys* and
    *values* at *row* (``(1,)`` int32, on the device:
    :func:`~turbospark.layers.layer_step.written`), the kernels' attention
    over *rows* of them, then the output gate and the layer's end; its
    outputs, then both buffers."""
    h, (queries, new_keys, new_values, gate) = _mixed(inputs, weights, stream, start, args, eps)
    keys, values = written(keys, values, new_keys, new_values, row)
    out = attend(queries, keys, values, rows, 1.0)
    return *_ended(h, out, gate, weights, side_input, by_kernel, eps, gelu), keys, values


def shared_layer(
    inputs: Inputs,
    stream: Stream,
    weights: StepWeights,
    start: mx.array,
    keys: mx.array,
    values: mx.array,
    rows: mx.array,
    side_input: mx.array | None,
    args: tuple,
    by_kernel: bool,
    eps: float,
    gelu: bool,
) -> tuple[mx.array, ...]:
    """A KV-shared layer's whole decode step: it writes no cache, so its
    queries, the attention over the rows its source layer attended and the
    layer's end are one trace."""
    h, (queries, _, _, gate) = _mixed(inputs, weights, stream, start, args, eps)
    out = attend(queries, keys, values, rows, 1.0)
    return _ended(h, out, gate, weights, side_input, by_kernel, eps, gelu)


@cache
def owner_trace(inputs: Inputs) -> Callable[..., Sequence[mx.array]]:
    """:func:`owner_layer` over *inputs*, compiled: traced once per stream
    form and buffer size (the rungs of the caches' growth ladder,
    :func:`~turbospark.state.kv.capacity_for`, each traced at load)."""
    return mx.compile(partial(owner_layer, inputs))


@cache
def shared_trace(inputs: Inputs) -> Callable[..., Sequence[mx.array]]:
    """:func:`shared_layer` over *inputs*, compiled."""
    return mx.compile(partial(shared_layer, inputs))


@dataclass(frozen=True)
class AttentionStep:
    """A self-attention layer's one-trace decode step, as its architecture
    states it: *inputs* (:data:`Inputs`: the heads from the projected row,
    its norms, RoPE and output gate), *weights* (:data:`MixerWeights` from the
    attention module; None where a projection is sharded or wrapped) and
    *paths* (to each parameter *weights* reads, under the attention module),
    under the layer's module names. State it once (a module constant): its
    traces are kept per *inputs* function (:func:`owner_trace`)."""

    inputs: Inputs
    weights: Callable[[nn.Module], MixerWeights | None]
    paths: Callable[[nn.Module], Sequence[tuple[Any, ...]]]
    mixer: str = "self_attn"
    input_norm: str = "input_layernorm"

    def __call__(
        self,
        layer: nn.Module,
        end: LayerEnd,
        x: mx.array | Unjoined,
        start: int | mx.array,
        shape: tuple[int, int, int],
        args: tuple,
        kv: object = None,
        shared: Attended | None = None,
        side_input: mx.array | None = None,
    ) -> tuple[mx.array | Unjoined, Attended] | None:
        """*layer*'s output for a lone row *x* and what it attended, as one
        traced call where the attention kernels take its *shape* (heads,
        K/V heads, head dim): over its cache *kv*, or with *kv* None over
        what the layer it shares K/V with attended (*shared*). *args* go to
        :attr:`inputs` after the start; *side_input* to the end. None where
        the step does not take this path (a shape the kernels do not take, a
        cache not yet prefilled or batched, a shared layer whose source ran
        its modules, a sharded or wrapped projection, queries, keys and
        values of more than one type), with nothing changed: the caller runs
        the modules."""
        if not kernels_take(*shape):
            return None
        if kv is None:  # KV-shared: the rows the layer it shares attended
            rows = kernel_rows(shared)
            if rows is None:
                return None
        elif not kernel_cache(kv):
            return None
        mixer = self.mixer
        weights = end.step_weights(
            layer,
            lambda: self.weights(layer[mixer]),
            lambda: [(mixer, *path) for path in self.paths(layer[mixer])],
            self.input_norm,
        )
        if weights is None:
            return None
        if isinstance(start, int):
            start = mx.array(start, dtype=mx.int32)
        by_kernel = end.by_kernel()
        stream, eps = stream_of(x), layer[self.input_norm].eps
        rest = (side_input, args, by_kernel, eps, end.gelu)
        if kv is None:
            keys, values, _ = shared
            out = shared_trace(self.inputs)(
                stream, weights, start, keys, values, rows.bounds, *rest
            )
            return end.stepped(weights[2], out, by_kernel), shared
        h = x.h if isinstance(x, Unjoined) else x
        if not h.dtype == kv.keys.dtype == weights[1][1].dtype:
            return None  # the kernels read queries, keys and values as one type
        out, attended = cache_step(owner_trace(self.inputs), kv, stream, weights, start, *rest)
        return end.stepped(weights[2], out, by_kernel), attended
