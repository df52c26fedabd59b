"""A gated-DeltaNet layer's decode step as one traced call, where the CUDA kernels run.

A lone row's decode step on a GPU is bound by the host (see
:mod:`turbospark.layers.layer_step`): run as one traced call, a pre-norm
layer whose mixer is a :class:`~turbospark.layers.gated_delta.layer.GatedDeltaNet`
is its input norm, the stacked input projections, the decode kernel
(:func:`~turbospark.layers.cuda.gdn.decode_mixer`: the projections' bias,
the causal conv over the session's conv tail, the recurrence, the gated
norm), the output projection and the layer's end
(:func:`~turbospark.layers.layer_end.step_end`). A family's layer calls
:func:`gated_delta_layer_step` with its :class:`~turbospark.layers.layer_end.LayerEnd`
and runs its modules where that returns None; it names no kernel.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from turbospark.layers.cuda import gdn as gdn_cuda
from turbospark.layers.cuda.norm import Unjoined
from turbospark.layers.gated_delta.gates import (
    decay_rate,
    float32_norm_weight,
    mixer_input_bias,
)
from turbospark.layers.gated_delta.layer import IN_PROJECTIONS
from turbospark.layers.gated_delta.state import GDNComponent
from turbospark.layers.layer_end import EndWeights, LayerEnd, step_end
from turbospark.layers.layer_step import Stream, flat, lifted, normed_stream, stream_of
from turbospark.layers.stacked import WeightT, matmul_t, readable, stacked, transposed

# What the step's mixer reads (mixer_weights): the input projections stacked
# and transposed (or packed: turbospark.layers.stacked.WeightT), the conv
# weight, the projections' bias, the decay rate, the gated norm's weight
# (float32) and the output projection transposed (or packed).
MixerWeights = tuple[WeightT | mx.array, ...]
# A step's weights: the input norm's, the mixer's and the layer end's
# (LayerEnd.step_weights).
StepWeights = tuple[mx.array, MixerWeights, EndWeights]


def mixer_weights(mixer: nn.Module) -> MixerWeights | None:
    """:data:`MixerWeights` of a :class:`~turbospark.layers.gated_delta.layer.GatedDeltaNet`;
    None where a projection is sharded or wrapped (the modules then run)."""
    projections, out = stacked(mixer, IN_PROJECTIONS), mixer["out_proj"]
    if projections is None or not readable(out):
        return None
    in_t = projections.weight_t
    return (
        in_t, mixer["conv1d"]["weight"], mixer_input_bias(mixer, in_t), decay_rate(mixer),
        float32_norm_weight(mixer), transposed(out),
    )  # fmt: skip


def mixer_paths(name: str) -> list[tuple[str, ...]]:
    """The paths from a layer to each parameter :func:`mixer_weights` reads of
    its mixer *name*."""
    paths = [(name, projection, "weight") for projection in (*IN_PROJECTIONS, "out_proj")]
    paths += [(name, "conv1d", "weight"), (name, "norm", "weight")]
    return [*paths, (name, "A_log"), (name, "dt_bias")]


def step_layer(
    stream: Stream,
    weights: StepWeights,
    tail: mx.array,
    recurrent: mx.array,
    dims: tuple[int, int, int, int],
    by_kernel: bool,
    eps: float,
    mixer_eps: float,
) -> tuple[mx.array, ...]:
    """The layer's whole decode step: the input norm, the stacked input
    projections, :func:`~turbospark.layers.cuda.gdn.decode_mixer` (the conv
    over *tail*, the recurrence from *recurrent*, the gated norm), then the
    layer's end (:func:`~turbospark.layers.layer_end.step_end`); its outputs,
    then the new conv tail and state. *dims* are the key and value heads and
    their widths."""
    input_w, (in_t, conv_w, in_bias, rate, norm_w, out_t), end = weights
    h, x = normed_stream(stream, input_w, eps)
    out, recurrent, tail = gdn_cuda.decode_mixer(
        matmul_t(x, in_t)[None], tail, conv_w, in_bias, rate, recurrent, norm_w, *dims, mixer_eps
    )
    return *lifted(step_end(h, flat(out), out_t, None, end, by_kernel, eps, False)), tail, recurrent


# Traced once per stream form (joined, or unjoined with the norm kernels).
step_trace = mx.compile(step_layer)


def gated_delta_layer_step(
    layer: nn.Module,
    end: LayerEnd,
    x: mx.array | Unjoined,
    gdn: GDNComponent | None,
    slot: int,
    mixer: str = "linear_attn",
    input_norm: str = "input_layernorm",
) -> mx.array | Unjoined | None:
    """*layer*'s output for a lone row *x* (``(1, 1, hidden)``) as one traced
    call (:func:`step_layer`), where the decode kernel runs: *layer* is
    pre-norm, its input norm *input_norm*, its mixer the gated DeltaNet
    *mixer* with its state at *slot* of *gdn*, its end *end*. The new conv
    tail and state go into *gdn*. None where the step does not take this
    path (no kernel here, a state not yet prefilled or being traced, a
    sharded or wrapped projection), with nothing changed: the caller runs
    the modules."""
    if not gdn_cuda.available() or gdn is None or gdn.tracing:
        return None
    tail, recurrent = gdn.layer(slot)
    weights = end.step_weights(
        layer, lambda: mixer_weights(layer[mixer]), lambda: mixer_paths(mixer), input_norm
    )
    if tail is None or recurrent is None or weights is None:
        return None
    d = layer[mixer].dims
    dims = (d.num_key_heads, d.num_value_heads, d.key_head_dim, d.value_head_dim)
    by_kernel = end.by_kernel()
    eps = layer[input_norm].eps
    *out, tail, recurrent = step_trace(
        stream_of(x), weights, tail, recurrent, dims, by_kernel, eps, d.eps
    )
    gdn.set_layer(slot, tail, recurrent)
    return end.stepped(weights[2], out, by_kernel)
