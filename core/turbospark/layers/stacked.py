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
checkpoint name and shape, and ``model.parameters()`` still lists them. Held
once as long as nothing else holds the arrays a stack was built from: the
runner drops the tensors it loaded before its warm-up builds the stacks.

A module whose weight (or scales, biases or bias) was replaced afterwards (a
reload, a test assigning weights) no longer matches the views held here, and
the stack is rebuilt from the new arrays on the next call. Sharded
projections (``AllToShardedLinear``, anything but a plain ``nn.Linear`` or
``nn.QuantizedLinear``) are never stacked: the caller then applies the
modules one by one.

A quantized projection (``nn.QuantizedLinear``, as mlx-lm's checkpoints load)
is read by a step as :class:`Packed`: its packed weight, scales and biases
with the packing as static values, so a compiled step takes the three arrays
as inputs and traces ``mx.quantized_matmul`` where a float one traces a
matmul (:func:`matmul_t`; a float weight's graph is unchanged), or on CUDA,
for a decode step's few rows, the qmv kernel (:mod:`turbospark.layers.cuda.qmv`). Quantized
projections of one packing stack as float ones do: the groups run along the
input axis, so concatenating the packed rows, scales and biases along the
output axis is exact. Projections of different packings (a mixed-precision
checkpoint: ``mlx_lm.convert --quant-predicate mixed_4_6`` packs some layers'
``v_proj`` at 6 bits beside 4-bit q/k) cannot share one array; their stack
reads them as :class:`PerModule`, one product per module concatenated, so the
layer keeps its one-trace step rather than falling back to the modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import is_
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from turbospark.layers import fused
from turbospark.layers.cuda import fmv as fmv_cuda
from turbospark.layers.cuda import qmv as qmv_cuda


class Packed(NamedTuple):
    """A quantized projection's weight as a step reads it: ``nn.QuantizedLinear``'s
    packed ``weight`` ``(out, packed in)``, ``scales`` and ``biases`` (None in
    the microscaling modes), and its packing. A NamedTuple, so ``mx.compile``
    takes the arrays as inputs and the packing as constants of the trace."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    group_size: int
    bits: int
    mode: str

    @property
    def columns(self) -> int:
        """The product's width (the projection's outputs)."""
        return self.weight.shape[0]


class PerModule(NamedTuple):
    """Projections of different packings read as one: each module's own
    ``weight.T`` or :class:`Packed`, their products concatenated along the
    outputs (:func:`matmul_t`). A NamedTuple of them, so ``mx.compile`` takes
    every array as an input and every packing as a constant, as for one."""

    parts: tuple[mx.array | Packed, ...]

    @property
    def columns(self) -> int:
        return sum(columns(part) for part in self.parts)


# A projection's weight as a step reads it: ``weight.T`` (float), packed, or
# the parts of a stack whose packings differ.
WeightT = mx.array | Packed | PerModule
# The module types whose weights a step reads itself (anything else, sharded
# or wrapped, is called).
READABLE = (nn.Linear, nn.QuantizedLinear)
_PACKED = ("weight", "scales", "biases")


def readable(module: nn.Module) -> bool:
    """Whether a step may read *module*'s weight itself: exactly an ``nn.Linear``
    or an ``nn.QuantizedLinear`` (not a sharded or wrapped subclass)."""
    return type(module) in READABLE


# On the CPU MLX's quantized product walks the weight once a row (its time
# grows with the rows), while its float matmul is a BLAS GEMM: a product of at
# least this many rows (a prefill chunk, a batched decode step) dequantizes
# the weight and takes the second form; a lone row keeps the first, which
# reads fewer bytes. docs/PERFORMANCE.md has the quantized CPU rows.
CPU_DEQUANTIZE_ROWS = 8
# The float weight such a product holds at once: a weight's rows are
# dequantized and multiplied this many bytes at a time, so a large model's
# transient stays one piece, not a whole projection in float.
CPU_DEQUANTIZE_PIECE_BYTES = 64 * 2**20


def dequantizes(x: mx.array) -> bool:
    """Whether a packed product of *x* dequantizes its weight for a float
    matmul: on the CPU, for at least :data:`CPU_DEQUANTIZE_ROWS` rows (a
    prefill chunk, a batched decode step of that many rows)."""
    return mx.default_device() == mx.cpu and x.size // x.shape[-1] >= CPU_DEQUANTIZE_ROWS


def _dequantized_product(x: mx.array, packed: Packed) -> mx.array:
    """``x @ dequantize(packed).T`` in pieces of the weight's rows of at most
    :data:`CPU_DEQUANTIZE_PIECE_BYTES` in *x*'s dtype, concatenated."""
    w, scales, biases, group_size, bits, mode = packed
    width = scales.shape[-1] * group_size
    rows = max(1, CPU_DEQUANTIZE_PIECE_BYTES // (width * x.dtype.size))
    pieces = [
        x
        @ mx.dequantize(
            w[i : i + rows],
            scales[i : i + rows],
            None if biases is None else biases[i : i + rows],
            group_size,
            bits,
            mode,
            dtype=x.dtype,
        ).T
        for i in range(0, w.shape[0], rows)
    ]
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)


def matmul_t(x: mx.array, weight_t: WeightT) -> mx.array:
    """``x @ weight_t``: a float weight's matmul, or the packed weight's
    ``mx.quantized_matmul`` (what ``nn.QuantizedLinear`` runs). On the CPU a
    product of many rows dequantizes the weight, in *x*'s dtype, and
    multiplies it as a float one (:func:`dequantizes`): the weight in float
    is held only while the product runs. On CUDA a
    product of a few rows (a decode step's) of an affine packing it fits is
    :func:`~turbospark.layers.cuda.qmv.qmv`'s kernel instead: MLX's reads a
    4-bit row at a fifth of the bandwidth (``docs/CUDA.md``); with
    ``TURBOSPARK_FMV_KERNEL=1`` a float product of 2 to 16 rows (a batched
    decode step's) is :func:`~turbospark.layers.cuda.fmv.fmv`'s kernel, where
    MLX's goes to cuBLASLt (off by default: the step measured slower with
    it). :class:`PerModule` are each part's product, concatenated."""
    if isinstance(weight_t, PerModule):
        return mx.concatenate([matmul_t(x, part) for part in weight_t.parts], axis=-1)
    if isinstance(weight_t, Packed):
        w, scales, biases, group_size, bits, mode = weight_t
        if qmv_cuda.takes(x, w, scales, biases, group_size, bits, mode):
            return qmv_cuda.qmv(x, w, scales, biases, group_size, bits)
        if dequantizes(x):
            return _dequantized_product(x, weight_t)
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode
        )
    if fmv_cuda.ENABLED and fmv_cuda.takes(x, weight_t):  # the switch first: every product asks
        return fmv_cuda.fmv(x, weight_t)
    return x @ weight_t


def columns(weight_t: WeightT) -> int:
    """The width of :func:`matmul_t`'s product."""
    return weight_t.columns if isinstance(weight_t, Packed | PerModule) else weight_t.shape[1]


def _packing(linear: nn.Module) -> tuple[int, int, str] | None:
    """A quantized linear's ``(group_size, bits, mode)``; None for a float one."""
    if type(linear) is nn.QuantizedLinear:
        return linear.group_size, linear.bits, linear.mode
    return None


def _packed(linear: nn.Module, packing: tuple[int, int, str]) -> Packed:
    return Packed(linear["weight"], linear["scales"], linear.get("biases"), *packing)


class Stacked:
    """The rows of some ``nn.Linear`` layers' weights (and biases) in one array,
    or of some ``nn.QuantizedLinear`` layers' of one packing (their packed
    weights, scales and biases, each in one array); layers of different
    packings (float beside quantized, or two bit widths) are held as
    :class:`PerModule`, each module's arrays its own.

    ``splits`` are the row offsets between the parts: ``mx.split(y, splits,
    axis=-1)`` of ``x @ weight.T`` gives each layer's output; ``weight_t`` is
    what :func:`matmul_t` reads: ``weight.T`` evaluated (a view of the same
    memory, no node per call), the stacked :class:`Packed`, or :class:`PerModule`."""

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        ends = [0]
        for linear in linears:
            ends.append(ends[-1] + linear["weight"].shape[0])
        self.splits = ends[1:-1]
        if len({_packing(linear) for linear in linears}) > 1:
            self._parts_of(linears)
            return
        packing = _packing(linears[0])
        names = ("weight",) if packing is None else _PACKED[: 2 + ("biases" in linears[0])]
        has_bias = "bias" in linears[0]
        names += ("bias",) * has_bias
        held = {name: mx.concatenate([linear[name] for linear in linears]) for name in names}
        mx.eval(held)
        self.weight: mx.array | None = held["weight"]
        self.bias = held.get("bias")
        if packing is None:
            self.weight_t: WeightT = self.weight.T
            mx.eval(self.weight_t)
        else:
            self.weight_t = Packed(held["weight"], held["scales"], held.get("biases"), *packing)
        # The modules now read their rows of the stack (views: one copy held).
        for name, value in held.items():
            for linear, part in zip(linears, mx.split(value, self.splits), strict=True):
                linear[name] = part
        mx.eval([linear.parameters() for linear in linears])
        # Every array stacked (a packed weight's scales and biases, a bias),
        # so a replaced scale rebuilds the stack as a replaced weight does.
        self._names = tuple(held)
        self._parts = [linear[name] for linear in linears for name in self._names]

    def _parts_of(self, linears: Sequence[nn.Module]) -> None:
        """Each module read as it is (:func:`transposed`), nothing copied: the
        stack of layers whose packings differ (none has a bias: :func:`stacked`)."""
        self.weight = self.bias = None
        self.weight_t = PerModule(tuple(transposed(linear) for linear in linears))
        self._names = _PACKED
        self._parts = [linear.get(name) for linear in linears for name in self._names]

    def matches(self, owner: nn.Module, names: Sequence[str]) -> bool:
        """Whether every module still holds the rows this stack gave it, of
        each array stacked (a module is a dict: item lookups, and the
        identities compared in C, as this runs for every layer and step)."""
        held = [owner[name].get(part) for name in names for part in self._names]
        return len(held) == len(self._parts) and all(map(is_, held, self._parts))

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Each layer's output for ``x`` ``(..., in)``, in the order they were stacked."""
        if self.bias is None:
            y = matmul_t(x, self.weight_t)
        else:
            y = gemm_add(self.bias, x, self.weight_t)
        return mx.split(y, self.splits, axis=-1)


def stacked(owner: nn.Module, names: tuple[str, ...]) -> Stacked | None:
    """The stack of *owner*'s linear layers *names* (built on first use, rebuilt
    when a weight was replaced), or None when any is neither a plain
    ``nn.Linear`` nor an ``nn.QuantizedLinear`` (sharded), when only some have
    a bias, or when they differ in packing (float and quantized, or two
    packings) and have biases; differing packings without biases stack as
    :class:`PerModule`."""
    # In the instance's __dict__, not set through Module.__setattr__: no parameter.
    stacks: dict[tuple[str, ...], Stacked] | None = owner.__dict__.get("_stacks")
    if stacks is None:
        stacks = owner.__dict__["_stacks"] = {}
    stack = stacks.get(names)
    if stack is not None and stack.matches(owner, names):
        return stack
    linears = [owner[name] for name in names]
    if not all(map(readable, linears)):
        return None
    if len({"bias" in linear for linear in linears}) != 1:
        return None
    if "bias" in linears[0] and len({_packing(linear) for linear in linears}) != 1:
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


def transposed(linear: nn.Module) -> WeightT:
    """What a step reads of *linear* (:func:`matmul_t`): its ``weight.T`` as an
    evaluated view (:func:`derived`), or a quantized linear's :class:`Packed`
    (kept alike, rebuilt when its weight, scales or biases were replaced)."""
    packing = _packing(linear)
    if packing is None:
        return derived(linear, "_transposed", linear["weight"], lambda weight: weight.T)
    held = linear.__dict__.get("_packed")
    if (
        held is None
        or held.weight is not linear["weight"]
        or held.scales is not linear["scales"]
        or held.biases is not linear.get("biases")
    ):
        held = linear.__dict__["_packed"] = _packed(linear, packing)
    return held


def project(linear: nn.Module, x: mx.array, residual: mx.array | None = None) -> mx.array:
    """``linear(x)``, plus *residual* when given: for a plain ``nn.Linear`` or
    ``nn.QuantizedLinear`` its own ops over :func:`transposed` (one node
    fewer; a packed weight's product in the form :func:`matmul_t` chooses for
    the device and the rows), a bias or the residual added by the GEMM itself
    (:func:`gemm_add`); any other module (sharded: it sums the ranks' parts)
    is called, and the residual added after it."""
    if not readable(linear):
        out = linear(x)
        return out if residual is None else residual + out
    weight_t = transposed(linear)
    if "bias" in linear:
        out = gemm_add(linear["bias"], x, weight_t)
        return out if residual is None else residual + out
    return matmul_t(x, weight_t) if residual is None else gemm_add(residual, x, weight_t)


def gemm_add(addend: mx.array, x: mx.array, weight_t: WeightT) -> mx.array:
    """``addend + x @ weight_t``, *addend* a bias ``(out,)`` or a residual
    shaped as the product, in the form each device runs fastest.

    - A packed weight (:class:`Packed`), or :class:`PerModule`: the product
      (:func:`matmul_t`), then the add (there is no quantized GEMM with a C
      operand).
    - On CUDA with ``TURBOSPARK_FMV_KERNEL=1``, a float product of 2 to 16
      rows (a batched decode step's): the few-row kernel
      (:func:`~turbospark.layers.cuda.fmv.fmv`), which adds a bias or a
      residual itself (an addend that broadcasts otherwise is added after it).

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
    if isinstance(weight_t, Packed | PerModule):
        return addend + matmul_t(x, weight_t)
    if fmv_cuda.ENABLED and fmv_cuda.takes(x, weight_t):
        if _adds(addend, x, weight_t):
            return fmv_cuda.fmv(x, weight_t, addend)
        return addend + fmv_cuda.fmv(x, weight_t)
    gpu = fused.builds_for_gpu()
    if gpu and x.size == x.shape[-1]:
        return addend + x @ weight_t
    lead = x.shape[:-1]
    if x.ndim < 3 or lead[0] == 1 or addend.shape[:-1] != lead or gpu:
        return mx.addmm(addend, x, weight_t)
    rows = mx.addmm(addend.reshape(-1, addend.shape[-1]), x.reshape(-1, x.shape[-1]), weight_t)
    return rows.reshape(*lead, weight_t.shape[-1])


def _adds(addend: mx.array, x: mx.array, weight_t: mx.array) -> bool:
    """Whether the few-row kernel adds *addend* itself: a bias ``(N,)`` or a
    residual shaped as the product, of the product's dtype."""
    product = (*x.shape[:-1], weight_t.shape[-1])
    return addend.dtype == x.dtype and (addend.shape == product[-1:] or addend.shape == product)
