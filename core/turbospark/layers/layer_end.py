"""A layer's end: the residual join after its mixer, the gated MLP and the last join.

A family states its layer's end as an architecture (:class:`LayerEnd`: which
norms sit around the mixer and the MLP, the MLP's activation, a side input
block, a layer scalar, under the checkpoint's module names) and calls it
with the mixer's output; the block chooses how it runs:

- the residual joins made with the norms beside them in one kernel each
  (:func:`~turbospark.layers.cuda.norm.join_norm`), where MLX's CUDA backend
  runs them, the last join handed on unjoined (:class:`Unjoined`) for the
  next norm to make;
- else the whole end as one traced call (:func:`tail`, compiled for the
  forwards :func:`~turbospark.layers.fused.runs_compiled` takes);
- steered, the steering traced into that call (:meth:`Join.fold
  <turbospark.contract.protocols.Join.fold>`);
- sharded, the modules themselves (they sum the ranks' parts).

A one-trace layer step (:mod:`turbospark.layers.layer_step`) ends
with :func:`step_end` inside its trace, and :meth:`LayerEnd.step_weights`
derives and keeps what that trace reads.

Two architectures here so far, each exactly the modules' ops:

- sandwich norms (Gemma): ``h += norm(mixed)``, ``ff = norm(mlp(norm(h)))``,
  then an optional side input block (Gemma's per-layer input:
  ``h += ff``, ``update = norm(act(h @ gate) * side_input @ proj)``) and
  ``(h + update) * layer_scalar``;
- pre-norm (Llama, Qwen): ``h += mixed``, ``h + mlp(norm(h))``, where the
  down projection's GEMM adds the residual
  (:func:`~turbospark.layers.stacked.gemm_add`), as the mixer's output
  projection may (:meth:`LayerEnd.joins_mixer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from turbospark.contract.protocols import Join
from turbospark.layers.cuda import norm as norm_cuda
from turbospark.layers.cuda.norm import Unjoined
from turbospark.layers.fused import geglu, residual_scale, runs_compiled, swiglu
from turbospark.layers.layer_step import MISSING, flat, held, kept
from turbospark.layers.stacked import WeightT, gemm_add, matmul_t, readable, stacked, transposed

# The side input block's weights: its input gate and projection as a step
# reads them (transposed, or packed: :data:`~turbospark.layers.stacked.WeightT`),
# and its norm's weight.
SideWeights = tuple[WeightT, WeightT, mx.array]
# What the end reads, in this order: the norm after the mixer (None: pre-norm),
# the MLP's norm, its gate and up rows stacked (transposed, or packed), the down
# projection's (alike), the norm after the MLP (or None), the side input
# block's (or None), the layer scalar (or None).
EndWeights = tuple[Any, ...]


def activation(x: mx.array, gate_up_t: WeightT, gelu: bool) -> mx.array:
    """The gated MLP's activation ``(..., inner)`` of its normed input *x*:
    the stacked gate and up rows, then GeGLU (*gelu*) or SwiGLU."""
    gate, up = mx.split(matmul_t(x, gate_up_t), 2, axis=-1)  # (..., inner) each
    return geglu(gate, up) if gelu else swiglu(gate, up)


def side_update(
    h: mx.array, side_input: mx.array, gate_t: WeightT, proj_t: WeightT, gelu: bool
) -> mx.array:
    """The side input block's update from the stream *h*, before its norm."""
    return matmul_t((geglu if gelu else swiglu)(matmul_t(h, gate_t), side_input), proj_t)


def side_parts(
    h: mx.array,
    ff: mx.array,
    side_input: mx.array | None,
    side: SideWeights | None,
    eps: float,
    gelu: bool,
) -> tuple[mx.array, mx.array]:
    """The residual after the (post-normed) feed-forward *ff* and the side
    input block where the architecture has one, as the two halves of the
    layer's last join."""
    if side is None:
        return h, ff
    gate_t, proj_t, norm_w = side
    h = h + ff
    return h, mx.fast.rms_norm(side_update(h, side_input, gate_t, proj_t, gelu), norm_w, eps)


def _mixed_in(h: mx.array, mixed: mx.array | None, post_mixer: mx.array | None, eps: float):
    """The stream after the mixer's join (*mixed* None: *h* holds it already)."""
    if mixed is None:
        return h
    return h + (mixed if post_mixer is None else mx.fast.rms_norm(mixed, post_mixer, eps))


def _pre_norm(weights: EndWeights) -> bool:
    """Whether the last join is the down projection's: no norm after the MLP,
    no side block, no scalar."""
    return weights[4] is None and weights[5] is None and weights[6] is None


def parts(
    h: mx.array,
    mixed: mx.array | None,
    side_input: mx.array | None,
    weights: EndWeights,
    eps: float,
    gelu: bool,
) -> tuple[mx.array, mx.array]:
    """The end up to its last join, ``(h, update)``: exactly the modules'
    ops (``nn.Linear`` is ``x @ w.T``, ``nn.RMSNorm`` is
    ``mx.fast.rms_norm``, ``nn.QuantizedLinear`` is ``mx.quantized_matmul``),
    over arrays so it compiles; the matmuls' weights come transposed, as leaf
    views, or packed (:mod:`turbospark.layers.stacked`)."""
    post_mixer, pre_mlp, gate_up_t, down_t, post_mlp, side, _ = weights
    h = _mixed_in(h, mixed, post_mixer, eps)
    ff = matmul_t(activation(mx.fast.rms_norm(h, pre_mlp, eps), gate_up_t, gelu), down_t)
    if post_mlp is not None:
        ff = mx.fast.rms_norm(ff, post_mlp, eps)
    return side_parts(h, ff, side_input, side, eps, gelu)


def _rows(x: mx.array | None) -> mx.array | None:
    """*x* ``(..., width)`` as two-dimensional rows ``(N, width)`` (a layer
    step's are already). MLX wraps every matmul of a 3-D input in a flatten
    and an unflatten, two graph nodes each (host time to build, replay and
    schedule); an end reads its inputs in up to four matmuls, so its rows go
    flat once on the way in and back once on the way out. The GEMMs' rows are
    the same either way: the same results."""
    return x if x is None or x.ndim == 2 else x.reshape(-1, x.shape[-1])


def tail(
    h: mx.array,
    mixed: mx.array | None,
    side_input: mx.array | None,
    weights: EndWeights,
    eps: float,
    gelu: bool,
) -> mx.array:
    """:func:`parts` and the last join: ``(h + update) * scale``, or for a
    pre-norm end the down projection's GEMM adding the residual
    (:func:`~turbospark.layers.stacked.gemm_add`, in the form each device
    runs fastest); over the inputs' rows (:func:`_rows`)."""
    shape = h.shape
    h, mixed, side_input = _rows(h), _rows(mixed), _rows(side_input)
    if _pre_norm(weights):
        _, pre_mlp, gate_up_t, down_t, *_ = weights
        h = _mixed_in(h, mixed, None, eps)
        out = gemm_add(h, activation(mx.fast.rms_norm(h, pre_mlp, eps), gate_up_t, gelu), down_t)
    else:
        h, update = parts(h, mixed, side_input, weights, eps, gelu)
        scale = weights[6]
        out = h + update if scale is None else residual_scale(h, update, scale)
    return out if out.shape == shape else out.reshape(shape)


def joins(
    h: mx.array,
    mixed: mx.array,
    side_input: mx.array | None,
    weights: EndWeights,
    eps: float,
    gelu: bool,
) -> tuple[mx.array, mx.array]:
    """:func:`parts` with every residual join made in one kernel with the
    norms beside it (:func:`~turbospark.layers.cuda.norm.join_norm`):
    ``(h, update)``, the last join left to the next norm (:func:`unjoined`);
    over the inputs' rows (:func:`_rows`) where a side input block's two
    matmuls make that pay, else in the layer's own shape (its gate and up rows
    in one matmul, the down projection's in another)."""
    post_mixer, pre_mlp, gate_up_t, down_t, post_mlp, side, _ = weights
    shape = h.shape
    if side is not None:
        h, mixed, side_input = _rows(h), _rows(mixed), _rows(side_input)
    h, x = norm_cuda.join_norm(h, mixed, pre_mlp, eps, update_weight=post_mixer)
    update = matmul_t(activation(x, gate_up_t, gelu), down_t)
    if side is not None:
        gate_t, proj_t, _ = side
        h, _ = norm_cuda.join_norm(h, update, None, eps, update_weight=post_mlp)
        update = side_update(h, side_input, gate_t, proj_t, gelu)
    if h.shape == shape:
        return h, update
    return h.reshape(shape), update.reshape(shape)


# Traced once per batch size (decode rows) and per short lone-row length (a
# verify pass); other prefill lengths vary, so they run uncompiled (runs_compiled).
tail_step = mx.compile(tail)
joins_step = mx.compile(joins)


def unjoined(weights: EndWeights, h: mx.array, update: mx.array, eps: float) -> Unjoined:
    """:func:`joins`'s ``(h, update)`` as the layer's output, its last join
    left to the next norm: the update's norm is the side block's, else the
    one after the MLP (or none), times the layer scalar (or not)."""
    side = weights[5]
    return Unjoined(h, update, weights[4] if side is None else side[2], weights[6], eps)


def step_end(
    h: mx.array,
    out: mx.array,
    out_t: WeightT,
    side_input: mx.array | None,
    weights: EndWeights,
    by_kernel: bool,
    eps: float,
    gelu: bool,
) -> tuple[mx.array, ...]:
    """Inside a layer step's trace, from its mixer's output *out* before the
    output projection *out_t* on, all ``(1, width)`` (:func:`flat`): with the
    norm kernels (*by_kernel*) :func:`joins`'s ``(h, update)``, else the
    layer's output alone (:func:`tail`; a pre-norm end adds the residual in
    the output projection's GEMM)."""
    if side_input is not None:
        side_input = flat(side_input)
    if by_kernel:
        return joins(h, matmul_t(out, out_t), side_input, weights, eps, gelu)
    if weights[0] is None:
        return (tail(gemm_add(h, out, out_t), None, side_input, weights, eps, gelu),)
    return (tail(h, matmul_t(out, out_t), side_input, weights, eps, gelu),)


Path = tuple[Any, ...]


@dataclass(frozen=True)
class LayerEnd:
    """A layer's end as its architecture states it, under the layer's own
    module names (the checkpoint's): the norm after the mixer (None:
    pre-norm), the MLP's norm, the gated MLP (``gate_proj``, ``up_proj``,
    ``down_proj``), the norm after it (or None), a side input block (its
    gate, projection and norm, or None), the layer scalar (or None); the
    activation (GeGLU where *gelu*, else SwiGLU) and the norms' eps."""

    pre_mlp: str
    eps: float
    gelu: bool = False
    post_mixer: str | None = None
    post_mlp: str | None = None
    side: tuple[str, str, str] | None = None
    scale: str | None = None
    mlp: str = "mlp"

    def __call__(
        self,
        layer: nn.Module,
        h: mx.array,
        mixed: mx.array | None,
        side_input: mx.array | None = None,
        join: Join | None = None,
    ) -> mx.array | Unjoined:
        """*layer*'s output from the stream *h* and its mixer's output *mixed*
        (None where the mixer's output projection added *h* in: see
        :meth:`joins_mixer`); with *join* (steering) the last join is handed
        to it. The norm kernels, the compiled step, the steered fold or the
        modules, as the module docstring says."""
        weights = self.weights(layer)
        if weights is None:  # sharded: the modules sum the ranks' parts
            h = h if mixed is None else h + self._post_mixer(layer, mixed)
            ff = layer[self.mlp](layer[self.pre_mlp](h))
            if self.post_mlp is not None:
                ff = layer[self.post_mlp](ff)
            return self.finish(layer, h, ff, side_input, join)
        compiled = runs_compiled(*h.shape[:2])
        args = (h, mixed, side_input, weights, self.eps, self.gelu)
        if join is None and norm_cuda.available():
            return unjoined(weights, *(joins_step if compiled else joins)(*args), self.eps)
        if join is None:
            return (tail_step if compiled else tail)(*args)
        # Steered: the steering traces into the compiled tail (one call, as unsteered).
        return join.fold(parts, args, weights[6], compiled)

    def _post_mixer(self, layer: nn.Module, mixed: mx.array) -> mx.array:
        return mixed if self.post_mixer is None else layer[self.post_mixer](mixed)

    def joins_mixer(self, layer: nn.Module, join: Join | None) -> bool:
        """Whether :meth:`__call__` joins the mixer's output with the norm
        kernels itself; else a pre-norm layer's mixer adds the residual in
        its output projection's GEMM and passes ``mixed=None``."""
        return join is None and norm_cuda.available() and self.weights(layer) is not None

    def by_kernel(self) -> bool:
        """Whether a layer step's trace ends with the norm kernels
        (:func:`step_end`'s *by_kernel*), here."""
        return norm_cuda.available()

    def finish(
        self,
        layer: nn.Module,
        h: mx.array,
        ff: mx.array,
        side_input: mx.array | None,
        join: Join | None,
    ) -> mx.array:
        """The end from the post-normed feed-forward *ff* on, uncompiled: the
        side input block and the last join (through *join* when steering). A
        layer whose feed-forward is not the gated MLP alone (Gemma's experts
        beside it) ends here."""
        h, update = side_parts(h, ff, side_input, self.side_weights(layer), self.eps, self.gelu)
        scale = None if self.scale is None else layer[self.scale]
        if join is not None:
            return join(h, update, scale)
        return h + update if scale is None else residual_scale(h, update, scale)

    def side_weights(self, layer: nn.Module) -> SideWeights | None:
        """The side input block's gate and projection (transposed or packed,
        :func:`~turbospark.layers.stacked.transposed`) and norm weight."""
        if self.side is None:
            return None
        gate, proj, norm = self.side
        return transposed(layer[gate]), transposed(layer[proj]), layer[norm]["weight"]

    def weights(self, layer: nn.Module) -> EndWeights | None:
        """:data:`EndWeights` from *layer*'s modules (the MLP's gate and up
        rows stacked: :func:`~turbospark.layers.stacked.stacked`), or None
        where the MLP is sharded or has biases (the modules then run it). A
        quantized MLP is read packed, as its float form is read transposed.

        Derived once and kept with the paths to each array it read
        (:func:`~turbospark.layers.layer_step.kept`), as a layer step's
        weights are: looking them up again (the stack's check, the
        accessors) cost each layer about 2 µs of host time a step on the
        CPU, where checking the links costs about 1. A layer has one end, so
        the layer holds one slot for it."""
        return kept(layer, lambda: self._weights(layer), self.paths, "_end")

    def _weights(self, layer: nn.Module) -> EndWeights | None:
        """:meth:`weights`, looked up from the modules."""
        mlp = layer[self.mlp]
        gate_up, down = stacked(mlp, ("gate_proj", "up_proj")), mlp["down_proj"]
        if gate_up is None or not readable(down):
            return None
        if gate_up.bias is not None or "bias" in down:  # the traced forms add none
            return None
        return (
            None if self.post_mixer is None else layer[self.post_mixer]["weight"],
            layer[self.pre_mlp]["weight"],
            gate_up.weight_t,
            transposed(down),
            None if self.post_mlp is None else layer[self.post_mlp]["weight"],
            self.side_weights(layer),
            None if self.scale is None else layer[self.scale],
        )

    def paths(self) -> list[Path]:
        """The paths from the layer to each parameter :meth:`weights` reads
        (:func:`~turbospark.layers.layer_step.kept`)."""
        found: list[Path] = [(self.mlp, name, "weight") for name in ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
        norms = (self.post_mixer, self.pre_mlp, self.post_mlp, *(self.side or ()))
        found += [(name, "weight") for name in norms if name is not None]
        return found if self.scale is None else [*found, (self.scale,)]

    def step_weights(
        self,
        layer: nn.Module,
        mixer: Callable[[], tuple[Any, ...] | None],
        mixer_paths: Callable[[], Sequence[Path]],
        input_norm: str = "input_layernorm",
    ) -> tuple[mx.array, tuple[Any, ...], EndWeights] | None:
        """What a layer step's trace reads besides its activations and state:
        the input norm's weight, the mixer's (``mixer()``, None where the
        mixer does not take the step) and :meth:`weights`; None where either
        is None. Derived once and kept with the paths to each
        (:func:`~turbospark.layers.layer_step.kept`), so a replaced module or
        array (a weight, a packed weight's scales or biases) derives them
        again; checked before the closures that would derive them are built
        (:func:`~turbospark.layers.layer_step.held`), as this runs for every
        layer and step."""
        weights = held(layer)
        if weights is not MISSING:
            return weights

        def derive() -> tuple[mx.array, tuple[Any, ...], EndWeights] | None:
            end = self.weights(layer)
            if end is None:
                return None
            mixing = mixer()
            return None if mixing is None else (layer[input_norm]["weight"], mixing, end)

        return kept(layer, derive, lambda: [(input_norm, "weight"), *mixer_paths(), *self.paths()])

    def stepped(self, weights: EndWeights, out: Sequence[mx.array], by_kernel: bool):
        """A layer step's outputs as the layer's output: :func:`unjoined`
        where it ended with the norm kernels, else the joined stream."""
        return unjoined(weights, out[0], out[1], self.eps) if by_kernel else out[0]
