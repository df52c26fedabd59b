"""What the one-trace layer steps share: the stream, two-dimensional rows, kept weights.

A lone row's decode step on a GPU is bound by the host: building the step's
graph in Python, then MLX encoding each kernel. A family whose layers run as
modules pays several traced calls, eager ops and accessor lookups a layer;
run as one traced call per layer, with the weights that call reads derived
once and kept, the same kernels cost a fraction of the host time (profiled
on the H200). Core's layer steps (a self-attention layer's:
:class:`~turbospark.layers.attention_step.AttentionStep`; a gated-DeltaNet
layer's: :func:`~turbospark.layers.gated_delta.step.gated_delta_layer_step`)
are built from the pieces here, as a family's own step for a mixer core has
none for would be:

- :data:`Stream`, :func:`stream_of` and :func:`normed_stream`: a layer's
  input as a traced call takes it, joined or
  :class:`~turbospark.layers.cuda.norm.Unjoined`;
- :func:`flat` and :func:`lifted`: rows in two dimensions inside the trace
  (MLX wraps a matmul of a 3-D input in a ``Flatten`` and an ``Unflatten``);
- :func:`kept`: the weights a layer's step reads, derived once and rebuilt
  when any module or parameter on the way to them was replaced;
- :func:`claim_rows`: a K/V-owning layer's rows for a trace that writes its
  new key and value itself;
- the attention kernels' step, taken without naming the kernels: whether
  they take a layer (:func:`kernels_take`, :func:`kernel_cache`,
  :func:`kernel_rows`), the trace that writes the new
  key and value and attends (:func:`cache_step`, :func:`written`,
  :func:`attend`). Each reads the kernel module when it runs, so a switch or a
  test's stand-in (``decode_ops`` on the CPU) reaches every family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

from turbospark.layers.cuda import attention as attention_cuda
from turbospark.layers.cuda import norm as norm_cuda
from turbospark.layers.cuda.norm import Unjoined
from turbospark.state.kv import LayerKV

# A layer's input stream in a traced step: joined, or an Unjoined's arrays
# (h, update, update_weight, scale), which a trace takes as a tuple.
Stream = mx.array | tuple[mx.array | None, ...]

T = TypeVar("T")


def stream_of(h: mx.array | Unjoined) -> Stream:
    """*h* as a traced call takes it: an :class:`Unjoined`'s arrays as a
    tuple (its eps is the layer's own, passed apart), else the array."""
    return tuple(h)[:4] if isinstance(h, Unjoined) else h


def normed_stream(stream: Stream, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """:func:`~turbospark.layers.cuda.norm.normed_input` of a traced step's
    stream: the joined stream and its norm, ``(1, hidden)`` each (:func:`flat`)."""
    if isinstance(stream, tuple):
        h, update, *rest = stream
        return norm_cuda.normed_input(Unjoined(flat(h), flat(update), *rest, eps=eps), weight, eps)
    return norm_cuda.normed_input(flat(stream), weight, eps)


def flat(x: mx.array) -> mx.array:
    """A lone token's row, ``(1, width)`` (from ``(1, 1, width)``, or an
    attention output's heads): a traced layer works in two dimensions, since
    MLX wraps a matmul of a 3-D input in a flatten and an unflatten (194
    graph nodes of a gemma4 step's 606, each host time to replay and to
    evaluate)."""
    return x.reshape(1, -1)


def lifted(out: Sequence[mx.array]) -> tuple[mx.array, ...]:
    """A traced step's ``(1, hidden)`` outputs back as ``(1, 1, hidden)``."""
    return tuple(x[None] for x in out)


Link = tuple[Any, Any, Any]  # (holder, key, value): holder[key] was value


def links(owner: nn.Module, paths: Sequence[tuple[Any, ...]]) -> list[Link]:
    """``(holder, key, value)`` for every link from *owner* along each of
    *paths* (keys into modules, lists and dicts), each link once. A path
    stops where a key is missing (a wrapped or sharded module with no
    ``weight`` of its own): the links before it still break when that
    module is replaced. A path to a module's array links every array that
    module holds beside it: a module's arrays are read together (a packed
    weight with its ``scales`` and ``biases``, a weight with its ``bias``),
    so replacing any of them breaks the link as replacing the weight does."""
    found: dict[tuple[int, Any], Link] = {}
    for path in paths:
        holder: Any = owner
        for key in path:
            if key not in holder:
                break
            value = holder[key]
            found[id(holder), key] = (holder, key, value)
            if isinstance(value, mx.array) and isinstance(holder, nn.Module):
                for name, array in holder.items():
                    if isinstance(array, mx.array):
                        found[id(holder), name] = (holder, name, array)
            holder = value
    return list(found.values())


def kept(
    owner: nn.Module,
    derive: Callable[[], T],
    paths: Callable[[], Sequence[tuple[Any, ...]]],
    slot: str = "_step",
) -> T:
    """``derive()``, kept in *owner*'s ``__dict__`` under *slot* (no
    parameter) with every link along ``paths()`` (each module and parameter
    on the way to what *derive* read, taken after it ran: stacking re-points
    the projections at their rows of the stack), and derived again when any
    link changed (:func:`held`): a replaced module breaks its link as a
    replaced weight does. The modules' own accessors cost a step about 20 µs
    a layer of host time to look up again, and checking one flat list of
    links about 2 (on the H200)."""
    value = held(owner, slot)
    if value is not MISSING:
        return value
    value = derive()
    owner.__dict__[slot] = (links(owner, paths()), value)
    return value


# What :func:`held` returns where nothing is kept (a kept value may be None).
MISSING: Any = object()


def held(owner: nn.Module, slot: str = "_step") -> Any:
    """What :func:`kept` holds in *owner*'s *slot* while every link still
    holds, else :data:`MISSING`: the check alone, for a caller that would
    otherwise build :func:`kept`'s closures every step to be told the same.

    Compared every call, not invalidated by a counter: MLX's ``Module`` is a
    ``dict``, and ``Module.update`` and attribute assignment write its items
    directly, with no hook to count them by, so only the identities show a
    replaced array. A list comprehension over the links is the cheapest
    check measured (about 1.5 µs for a gemma4 layer's 36 links on the CPU;
    ``map`` over ``operator.getitem`` and ``is_``, or the ids compared as
    one list, cost more)."""
    kept_value = owner.__dict__.get(slot)
    if kept_value is not None and all([h[key] is value for h, key, value in kept_value[0]]):
        return kept_value[1]
    return MISSING


def claim_rows(kv: LayerKV) -> tuple[attention_cuda.Rows, mx.array]:
    """:meth:`LayerKV.claim <turbospark.state.kv.LayerKV.claim>` for a traced
    step that scatters its new key and value in itself (:meth:`LayerKV.write
    <turbospark.state.kv.LayerKV.write>`): the rows its query attends over and
    the row it writes, ``(1,)`` int32. Each is at most eight bytes, what
    MLX's CUDA allocator serves from its small pool (see
    :class:`~turbospark.layers.cuda.attention.Rows`).

    The caller passes the buffers to its trace from *kv* alone and replaces
    them with the trace's outputs: the trace then holds the only reference,
    so MLX writes them in place."""
    first, stop = kv.claim()
    return attention_cuda.Rows(first, stop), mx.array([stop - 1], dtype=mx.int32)


def kernels_available() -> bool:
    """Whether a lone row's decode attention takes the CUDA kernels here
    (MLX's CUDA backend, the switch on: :func:`~turbospark.layers.cuda.attention.available`)."""
    return attention_cuda.available()


def kernels_take(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the attention kernels take a layer of *heads* queries over
    *kv_heads* keys and values of *head_dim*, here
    (:func:`~turbospark.layers.cuda.attention.takes_shape`)."""
    return attention_cuda.takes_shape(heads // kv_heads, head_dim, head_dim)


def kernel_cache(kv: object) -> bool:
    """Whether *kv* is what a kernel step writes into: one session's
    :class:`~turbospark.state.kv.LayerKV` with buffers (a prefilled cache;
    a batch's rows, a fresh cache and a quantized one take the modules' path)."""
    return isinstance(kv, LayerKV) and kv.keys is not None and kv.quant is None


def kernel_rows(attended: tuple[Any, Any, Any] | None) -> attention_cuda.Rows | None:
    """The rows a kernel step attended, from what a layer attended (its
    buffers and, where the mask goes, :class:`~turbospark.layers.cuda.attention.Rows`);
    None where that layer ran the modules: a layer that shares its K/V then
    runs them too."""
    if attended is None or not isinstance(attended[2], attention_cuda.Rows):
        return None
    rows = attended[2]
    return rows if rows.left is None else None  # a batch's: the steps are a lone row's


def cache_step(
    step: Callable[..., Sequence[mx.array]],
    kv: LayerKV,
    stream: Stream,
    weights: Any,
    start: mx.array,
    *rest: Any,
) -> tuple[list[mx.array], tuple[mx.array, mx.array, attention_cuda.Rows]]:
    """A K/V-owning layer's one-trace decode step over *kv*'s buffers:
    ``step(stream, weights, start, keys, values, rows, row, *rest)`` returns
    its outputs, then both buffers with the new key and value written
    (:func:`written`). It claims the rows itself; the buffers go
    in from *kv* alone and its fields take the trace's outputs, so MLX writes
    them in place. The step's outputs, and what the layer attended (for the
    layers that share its K/V)."""
    rows, row = claim_rows(kv)
    *out, kv.keys, kv.values = step(
        stream, weights, start, kv.keys, kv.values, rows.bounds, row, *rest
    )
    return out, (kv.keys, kv.values, rows)


def written(
    keys: mx.array, values: mx.array, new_keys: mx.array, new_values: mx.array, row: mx.array
) -> tuple[mx.array, mx.array]:
    """Inside a step's trace: the buffers with the step's key and value
    scattered in at *row* (:meth:`LayerKV.write <turbospark.state.kv.LayerKV.write>`)."""
    return LayerKV.write(keys, new_keys, row), LayerKV.write(values, new_values, row)


def attend(
    queries: mx.array, keys: mx.array, values: mx.array, rows: mx.array, scale: float
) -> mx.array:
    """Inside a step's trace: one query a head over *rows* (an int32 pair on
    the device) of the whole buffers, by the kernels
    (:func:`~turbospark.layers.cuda.attention.decode`); ``(1, heads, 1, Dv)``."""
    return attention_cuda.decode(queries, keys, values, rows, scale)
