"""Several projections of one input as one matmul: their weights stacked by rows.

A decode step on a GPU is launch-bound, so q/k/v (or gate/up, or a gated
DeltaNet's four input projections) cost three launches where one would do.
And every graph node costs host time to build and to schedule, view or not:
``x @ w.T`` is two nodes per call (a Transpose, then the Matmul), so the stack
keeps its weight's transpose as a leaf array, and :func:`transposed` does the
same for any single ``nn.Linear`` a compiled step reads.
:func:`stacked` concatenates the ``nn.Linear`` weights once, on first use,
and re-points each module's ``weight`` at its rows of the stacked array
(views, no copy), so the weights are held once, every parameter keeps its
checkpoint name and shape, and ``model.parameters()`` still lists them.

A module whose weight was replaced afterwards (a reload, a test assigning
weights) no longer matches the views held here, and the stack is rebuilt from
the new weights on the next call. Sharded projections (``AllToShardedLinear``,
anything but a plain ``nn.Linear``) are never stacked: the caller then applies
the modules one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import is_

import mlx.core as mx
import mlx.nn as nn

from turbospark.layers import fused


class Stacked:
    """The rows of some ``nn.Linear`` layers' weights (and biases) in one array.

    ``splits`` are the row offsets between the parts: ``mx.split(y, splits,
    axis=-1)`` of ``x @ weight.T`` gives each layer's output; ``weight_t`` is
    ``weight.T``, evaluated (a view of the same memory, no node per call)."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        weight = mx.concatenate([linear.weight for linear in linears], axis=0)
        has_bias = "bias" in linears[0]
        bias = mx.concatenate([linear.bias for linear in linears], axis=0) if has_bias else None
        mx.eval(weight, *([] if bias is None else [bias]))
        ends = [0]
        for linear in linears:
            ends.append(ends[-1] + linear.weight.shape[0])
        self.splits = ends[1:-1]
        self.weight = weight
        self.weight_t = weight.T
        self.bias = bias
        mx.eval(self.weight_t)
        # The modules now read their rows of the stack (views: one copy held).
        for linear, part in zip(linears, mx.split(weight, self.splits, axis=0), strict=True):
            linear.weight = part
        if bias is not None:
            for linear, part in zip(linears, mx.split(bias, self.splits), strict=True):
                linear.bias = part
        mx.eval([linear.parameters() for linear in linears])
        self._parts = [linear.weight for linear in linears]

    def matches(self, owner: nn.Module, names: Sequence[str]) -> bool:
        """Whether every module still holds the rows this stack gave it (a
        module is a dict: item lookups, and the identities compared in C, as
        this runs for every layer and step)."""
        held = [owner[name]["weight"] for name in names]
        return len(held) == len(self._parts) and all(map(is_, held, self._parts))

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Each layer's output for ``x`` ``(..., in)``, in the order they were stacked."""
        y = x @ self.weight_t if self.bias is None else gemm_add(self.bias, x, self.weight_t)
        return mx.split(y, self.splits, axis=-1)


def stacked(owner: nn.Module, names: tuple[str, ...]) -> Stacked | None:
    """The stack of *owner*'s linear layers *names* (built on first use, rebuilt
    when a weight was replaced), or None when any is not a plain ``nn.Linear``
    (sharded) or only some have a bias."""
    # In the instance's __dict__, not set through Module.__setattr__: no parameter.
    stacks: dict[tuple[str, ...], Stacked] | None = owner.__dict__.get("_stacks")
    if stacks is None:
        stacks = owner.__dict__["_stacks"] = {}
    stack = stacks.get(names)
    if stack is not None and stack.matches(owner, names):
        return stack
    linears = [owner[name] for name in names]
    if any(type(linear) is not nn.Linear for linear in linears):
        return None
    if len({"bias" in linear for linear in linears}) != 1:
        return None
    stack = stacks[names] = Stacked(linears)
    return stack


def derived(
    owner: nn.Module, name: str, source: mx.array, build: Callable[[mx.array], mx.array]
) -> mx.array:
    """``build(source)`` for one of *owner*'s parameters, evaluated once (no node
    in any graph), kept in the module's ``__dict__`` under *name* (no
    parameter) and rebuilt when *source* was replaced (a load, a shard)."""
    held = owner.__dict__.get(name)
    if held is not None and held[0] is source:
        return held[1]
    value = build(source)
    mx.eval(value)
    owner.__dict__[name] = (source, value)
    return value


def transposed(linear: nn.Module) -> mx.array:
    """*linear*'s ``weight.T`` as an evaluated view (:func:`derived`)."""
    return derived(linear, "_transposed", linear["weight"], lambda weight: weight.T)


def project(linear: nn.Module, x: mx.array, residual: mx.array | None = None) -> mx.array:
    """``linear(x)``, plus *residual* when given: for a plain ``nn.Linear`` its
    own ops over :func:`transposed` (one node fewer), a bias or the residual
    added by the GEMM itself (:func:`gemm_add`); any other module (sharded:
    it sums the ranks' parts) is called, and the residual added after it."""
    if type(linear) is not nn.Linear:
        out = linear(x)
        return out if residual is None else residual + out
    weight_t = transposed(linear)
    if "bias" in linear:
        out = gemm_add(linear["bias"], x, weight_t)
        return out if residual is None else residual + out
    return x @ weight_t if residual is None else gemm_add(residual, x, weight_t)


def gemm_add(addend: mx.array, x: mx.array, weight_t: mx.array) -> mx.array:
    """``addend + x @ weight_t``, *addend* a bias ``(out,)`` or a residual
    shaped as the product, in the form each device runs fastest.

    - Mostly one GEMM, ``addmm`` with *addend* as its C operand: one kernel
      where a matmul and an add were two.
    - On a GPU (:func:`~turbospark.layers.fused.builds_for_gpu`, the switch
      every GPU-only form reads), a product of one row (a lone decode step) is
      a matmul, then the add: MLX's CUDA ``addmm`` always goes to cuBLASLt,
      which for one row is a split-K GEMM, its reduction kernel and a child
      graph captured per call, while a one-row matmul is MLX's own gemv, one
      kernel node. The step is host-bound, and on the H200 this form decoded
      faster in every paired process (``bench/README.md``, "One-row GEMMs as
      MLX's gemv and an add").
    - On the CPU, a residual over several rows in *x*'s leading batch axis (a
      batched decode step, a prefill group) has those axes folded into the
      GEMM's rows first: MLX's CPU ``addmm`` with a batched C operand runs one
      product per batch row, each reading the whole weight (16 decode rows of
      an 8192 -> 2048 projection: 114 ms against 13 ms folded). CUDA's does not (the H200: the same
      time either way).
    """
    gpu = fused.builds_for_gpu()
    if gpu and x.size == x.shape[-1]:
        return addend + x @ weight_t
    lead = x.shape[:-1]
    if x.ndim < 3 or lead[0] == 1 or addend.shape[:-1] != lead or gpu:
        return mx.addmm(addend, x, weight_t)
    rows = mx.addmm(addend.reshape(-1, addend.shape[-1]), x.reshape(-1, x.shape[-1]), weight_t)
    return rows.reshape(*lead, weight_t.shape[-1])
