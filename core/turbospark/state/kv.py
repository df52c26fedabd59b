"""Attention K/V: one layer's, a group of layers' (a state component), and the batched forms.

A session's K/V grows in blocks and, for a sliding window, keeps a ring
(:class:`LayerKV`); :class:`KVComponent` is the component of a group of layers.

**Growth ladder.** A lone session's buffers only ever take a capacity from
one fixed ladder (:func:`capacity_for`): multiples of :data:`STEP` (256 rows,
mlx-lm's ``KVCache.step``) up to :data:`FINE_UNTIL`, then :data:`PER_OCTAVE`
sizes an octave (spaced ``2**k / 32``: 512 rows past 16k, 1024 past 32k). A
traced decode step (the CUDA kernels' path, :mod:`turbospark.layers.attention_step`)
sees the whole buffers, so it is traced once per capacity; with every
session's capacities on one ladder a process traces each rung once, and
the runner traces every rung up to its context length at load
(``Runner.warm_up``), so no step on the user's path traces. What the ladder
costs: at most ``1/32`` of a buffer beyond mlx-lm's step-256 growth (3 %,
and none below 8k rows), and a buffer still grows by at least :data:`STEP`
rows (a window's ring still trims at most once every 256 steps). A batch's
buffers (:class:`BatchLayerKV`) keep growing by steps: a batched step takes
the modules' path, which sees only the columns in use, never the capacity.

Continuous batching decodes every active session in one forward. While a
session is in the batch its state lives here, merged with the others'; it
joins once (its arrays are copied in, a cost proportional to its size) and
leaves once (its rows are copied out into a one-row component again), so a
decode step never pays per session, and parked sessions are never touched.

Attention K/V of sessions at different positions are **left-padded** and
right-aligned, as in mlx-lm's ``BatchKVCache``: column ``c`` of row ``i`` holds
absolute position ``position_i - (fill - c)``, the columns before ``left[i]``
are padding, and every row writes its next token into the same column. A
sliding window is then the same column distance for every row, so the ring's
retention (``window - 1 + headroom``) trims leading columns for all rows at
once. RoPE takes the per-row positions as an offset array. Rows that fed
fewer tokens than the others in one write (a prefill group's shorter
prompts, padded at the end) are shifted right past their padding
(:meth:`BatchLayerKV.shift`: one gather a buffer), so they end in the same
column again and the padding is gone.

Recurrent state (gated DeltaNet) needs no padding: its arrays are simply
concatenated (see :class:`turbospark.layers.gated_delta.state.GDNComponent`).

A component opts in with a ``merge(parts)`` classmethod returning a batched
component that offers ``extend``, ``filter`` and ``extract``
(:class:`~turbospark.state.components.BatchedComponent`), and its :class:`~turbospark.contract.hookspecs.ComponentSpec`
says ``batchable=True``.

**Quantized K/V.** With a :class:`KVQuantization` (``--kv-bits``), every
layer stores its keys and values as ``mx.quantize``'s ``(data, scales,
biases)`` (:class:`QuantizedRows`), exactly as mlx-lm's ``QuantizedKVCache``
does, and attention reads them through ``mx.quantized_matmul``
(:func:`turbospark.layers.attention.quantized_attention`). Each token's row
is quantized on its own (groups run along the head dim), so every move here
(growing, the ring's trim, merging, padding, filtering, extracting,
snapshots) is the same slice of the three arrays that it is of one. A cache
is quantized from its first token, so a session's memory is bounded by the
setting from the start (mlx-lm waits ``quantized_kv_start`` tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Literal, NamedTuple

import mlx.core as mx
from pydantic import BaseModel, ConfigDict

from turbospark.errors import InvalidInput
from turbospark.state.components import (
    BatchedComponent,
    Capabilities,
    LayeredComponent,
    Snapshot,
    State,
)

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)

# The growth ladder (see the module): rows a buffer grows by at least, the
# capacity up to which every multiple of it is a rung, and rungs an octave past it.
STEP = 256
FINE_UNTIL = 8192
PER_OCTAVE = 32


def capacity_for(rows: int) -> int:
    """The smallest rung of the growth ladder holding *rows*: a multiple of
    :data:`STEP` up to :data:`FINE_UNTIL`, then a multiple of an octave's
    ``1/PER_OCTAVE`` (so a buffer wastes at most that share of itself)."""
    if rows <= FINE_UNTIL:
        return max(1, -(-rows // STEP)) * STEP
    spacing = max(STEP, (1 << ((rows - 1).bit_length() - 1)) // PER_OCTAVE)
    return -(-rows // spacing) * spacing


def ladder(limit: int) -> list[int]:
    """Every rung of the growth ladder up to the one holding *limit* rows."""
    rungs = [STEP]
    while rungs[-1] < limit:
        rungs.append(capacity_for(rungs[-1] + 1))
    return rungs


class KVQuantization(BaseModel):
    """How attention K/V are stored: ``mx.quantize``'s affine form at *bits*,
    in groups of *group_size* along the head dim (mlx-lm's ``--kv-bits`` and
    ``--kv-group-size``, default 64 as there). One per runner: every session
    it serves holds K/V of one setting, so no two are ever mixed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bits: Literal[4, 8]
    group_size: Literal[32, 64, 128] = 64

    @classmethod
    def of(cls, bits: int | None, group_size: int = 64) -> KVQuantization | None:
        """The setting for *bits* (None: full-precision K/V), refused in one
        line naming the fix where MLX cannot quantize to it."""
        if bits is None:
            return None
        if bits not in KV_BITS:
            raise InvalidInput(
                f"--kv-bits {bits}: K/V quantize to 4 or 8 bits; pass --kv-bits 4 or "
                "--kv-bits 8, or leave it out for full-precision K/V"
            )
        if group_size not in KV_GROUP_SIZES:
            raise InvalidInput(
                f"--kv-group-size {group_size}: MLX quantizes in groups of 32, 64 or 128; "
                "pass one of those (64 is mlx-lm's default)"
            )
        return cls(bits=bits, group_size=group_size)  # type: ignore[arg-type]

    def check_head_dims(self, dims: Iterable[int], family: str) -> None:
        """Refuse a group size that does not divide every attention head dim
        (each group's scale and bias cover *group_size* of one head's values)."""
        for dim in sorted(set(dims)):
            if dim % self.group_size:
                raise InvalidInput(
                    f"--kv-group-size {self.group_size} does not divide family '{family}''s "
                    f"attention head dim {dim}; pass a --kv-group-size (32, 64 or 128) "
                    f"that divides {dim}"
                )

    def describe(self) -> str:
        return f"{self.bits}-bit, group {self.group_size}"


def describe_kv(quant: KVQuantization | None) -> str:
    """The K/V setting in words (the sessions view, refusals): 'full precision' or bits and group."""
    return "full precision" if quant is None else quant.describe()


class QuantizedRows(NamedTuple):
    """Keys or values as ``mx.quantize`` returns them (``data`` uint32,
    ``scales`` and ``biases`` in the model's dtype, each ``(B, heads, T, n)``),
    with the setting that reads them back."""

    data: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    def map(self, fn: Callable[[mx.array], mx.array]) -> QuantizedRows:
        return QuantizedRows(fn(self.data), fn(self.scales), fn(self.biases), *self[3:])

    @property
    def parts(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.data, self.scales, self.biases

    @property
    def shape(self) -> tuple[int, ...]:
        """The rows' shape but the last axis (the data's: packed)."""
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


# Keys or values as a cache holds them: one array, or its quantized parts.
Rows = mx.array | QuantizedRows


def quantize_rows(rows: mx.array, quant: KVQuantization | None) -> Rows:
    """*rows* ``(B, heads, L, D)`` as a cache stores them under *quant*."""
    if quant is None:
        return rows
    data, scales, biases = mx.quantize(rows, group_size=quant.group_size, bits=quant.bits)
    return QuantizedRows(data, scales, biases, quant.bits, quant.group_size)


def _map(rows: Rows, fn: Callable[[mx.array], mx.array]) -> Rows:
    return rows.map(fn) if isinstance(rows, QuantizedRows) else fn(rows)


def _parts(rows: Rows) -> tuple[mx.array, ...]:
    return rows.parts if isinstance(rows, QuantizedRows) else (rows,)


def _assign(buffer: Rows, index: tuple[slice, ...], new: Rows) -> None:
    """``buffer[index] = new``, in place, part by part."""
    for mine, theirs in zip(_parts(buffer), _parts(new), strict=True):
        mine[index] = theirs


def _zeros(like: Rows, batch: int, length: int) -> Rows:
    """Zeros of *like*'s heads, widths and dtypes, *batch* rows of *length* tokens."""
    return _map(like, lambda a: mx.zeros((batch, a.shape[1], length, a.shape[3]), a.dtype))


def _concat(first: Rows, second: Rows) -> Rows:
    """*first* then *second* along the token axis."""
    if isinstance(first, QuantizedRows):
        assert isinstance(second, QuantizedRows)
        joined = (
            mx.concatenate([a, b], axis=2) for a, b in zip(first.parts, second.parts, strict=True)
        )
        return QuantizedRows(*joined, first.bits, first.group_size)
    assert isinstance(second, mx.array)
    return mx.concatenate([first, second], axis=2)


def _nbytes(rows: Rows | None) -> int:
    return 0 if rows is None else rows.nbytes


def _snap(rows: Rows, prefix: str) -> Snapshot:
    if isinstance(rows, QuantizedRows):
        return {prefix: rows.data, f"{prefix}.scales": rows.scales, f"{prefix}.biases": rows.biases}
    return {prefix: rows}


def _unsnap(snapshot: Mapping[str, mx.array], prefix: str, quant: KVQuantization | None) -> Rows:
    """The rows :func:`_snap` wrote, refused where they were written under
    another K/V setting than *quant* (the session file's identity keeps such a
    file out; this keeps any other caller honest)."""
    quantized = f"{prefix}.scales" in snapshot
    if quantized != (quant is not None):
        raise InvalidInput(
            f"a snapshot's {prefix} holds {'quantized' if quantized else 'full-precision'} "
            f"K/V and this cache stores {describe_kv(quant)}; restore it into a runner "
            "opened with the K/V setting it was written under"
        )
    if quant is None:
        return snapshot[prefix]
    data, scales, biases = (snapshot[f"{prefix}{end}"] for end in ("", ".scales", ".biases"))
    expected = scales.shape[-1] * quant.group_size * quant.bits // 32
    if data.shape[-1] != expected:
        raise InvalidInput(
            f"a snapshot's {prefix} was quantized under another --kv-bits/--kv-group-size "
            f"than this cache's ({quant.describe()}); restore it into a runner opened with "
            "the K/V setting it was written under"
        )
    return QuantizedRows(data, scales, biases, quant.bits, quant.group_size)


def quantize_kv(state: State, quant: KVQuantization | None) -> State:
    """*state* (fresh from the family's hook) with every attention K/V
    component storing its rows under *quant*; other components (recurrent
    state) untouched. The runner applies it to every state it makes, so a
    family never needs to know the setting."""
    if quant is not None:
        for component in state.values():
            if isinstance(component, KVComponent):
                component.quantize(quant)
    return state


def _visible_from(window: int | None, fill: int, length: int) -> int:
    """The first buffer row any of the last *length* queries of *fill* rows
    sees: a windowed layer's first query sees ``window - 1`` rows before its
    own, so older rows (kept only as rewind headroom) are not fetched: their
    attention would be masked out anyway. One query needs no mask then."""
    if window is None:
        return 0
    return max(0, fill - length - (window - 1))


class LayerKV:
    """Keys and values of one attention layer, optionally limited to a sliding window.

    Buffers grow by at least ``step`` rows to a rung of the growth ladder
    (:func:`capacity_for`, see the module) and are written in place (as
    mlx-lm's ``KVCache`` does), so decode never re-copies the history and a
    traced step meets only the ladder's capacities. A windowed layer
    keeps at least ``window - 1 + headroom`` recent tokens: ``window - 1`` are
    what the next query attends to, ``headroom`` is how far it can rewind.
    ``base`` is the absolute position of buffer row 0. With *quant* the rows
    are stored quantized (:class:`QuantizedRows`; see the module).
    """

    step = STEP

    def __init__(
        self, window: int | None = None, headroom: int = 0, quant: KVQuantization | None = None
    ):
        self.window = window
        self.headroom = headroom
        self.quant = quant
        self.keys: Rows | None = None
        self.values: Rows | None = None
        self.base = 0
        self.fill = 0

    @property
    def position(self) -> int:
        return self.base + self.fill

    @property
    def retain(self) -> int | None:
        return None if self.window is None else self.window - 1 + self.headroom

    def reset(self) -> None:
        self.keys = self.values = None
        self.base = self.fill = 0

    @property
    def max_safe_rewind(self) -> int:
        if self.base == 0 or self.window is None:  # a full layer may start past 0 (an MTP head's)
            return self.fill
        return max(0, self.fill - (self.window - 1))

    def rewind(self, n: int) -> None:
        self.fill -= n

    def _make_room(self, keys: Rows, values: Rows, length: int) -> None:
        """Room for *length* more rows (*keys* and *values* give the heads,
        widths and dtypes of new buffers)."""
        if self.keys is not None and self.fill + length <= self.keys.shape[2]:
            return
        if self.keys is not None and self.retain is not None and self.fill > self.retain:
            # Drop rows the window can no longer reach (keeping the rewind headroom).
            drop, fill = self.fill - self.retain, self.fill
            self.keys = _map(self.keys, lambda a: a[:, :, drop:fill])
            self.values = _map(self.values, lambda a: a[:, :, drop:fill])
            self.base += drop
            self.fill -= drop
        grow = capacity_for(self.fill + max(length, self.step)) - self.fill
        k_new, v_new = _zeros(keys, 1, grow), _zeros(values, 1, grow)
        if self.keys is None or self.values is None:
            self.keys, self.values = k_new, v_new
        else:
            fill = self.fill
            self.keys = _concat(_map(self.keys, lambda a: a[:, :, :fill]), k_new)
            self.values = _concat(_map(self.values, lambda a: a[:, :, :fill]), v_new)

    def update(self, keys: mx.array, values: mx.array) -> tuple[int, int]:
        """Append ``(1, heads, L, dim)`` keys/values (quantized first, under a
        quantized cache); return the buffer rows ``[start, stop)`` the new
        queries attend over (with the mask, for several)."""
        length = keys.shape[2]
        keys, values = quantize_rows(keys, self.quant), quantize_rows(values, self.quant)
        self._make_room(keys, values, length)
        assert self.keys is not None and self.values is not None
        rows = (slice(None), slice(None), slice(self.fill, self.fill + length))
        _assign(self.keys, rows, keys)
        _assign(self.values, rows, values)
        return self._advance(length)

    def claim(self) -> tuple[int, int]:
        """:meth:`update` for one token whose key and value the caller writes
        to buffer row ``stop - 1`` itself (a traced decode step, which
        scatters them in on the device: :meth:`write`): room made and the fill
        advanced as for a write here. Needs buffers already (a prefill)."""
        assert self.keys is not None and self.values is not None, "claim() follows a prefill"
        self._make_room(self.keys, self.values, 1)
        return self._advance(1)

    @staticmethod
    def write(buffer: mx.array, new: mx.array, row: mx.array) -> mx.array:
        """*buffer* ``(1, heads, N, D)`` with *new* ``(1, heads, 1, D)`` at row
        *row* (an int32 array on the device, so one trace serves every row),
        as one scatter: where the caller holds no other reference to
        *buffer*, MLX writes in place (donation), as :meth:`update`'s slice
        assignment does. A write with the row as a slice start would be a
        ``DynamicSliceUpdate``, whose offset MLX's CUDA backend reads back on
        the host (a stream sync)."""
        return mx.put_along_axis(buffer, mx.broadcast_to(row, new.shape), new, axis=2)

    def _advance(self, length: int) -> tuple[int, int]:
        self.fill += length
        return _visible_from(self.window, self.fill, length), self.fill

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Rows, Rows, int]:
        """:meth:`update`, then those rows and the absolute position of the
        first one (for the mask)."""
        start, stop = self.update(keys, values)
        assert self.keys is not None and self.values is not None
        return (
            _map(self.keys, lambda a: a[:, :, start:stop]),
            _map(self.values, lambda a: a[:, :, start:stop]),
            self.base + start,
        )

    def mask(self, queries: int, key_start: int, keys: int) -> mx.array | str | None:
        """The attention mask for the last ``queries`` positions against ``keys``
        rows starting at absolute position ``key_start``."""
        if queries == 1 and (self.window is None or keys <= self.window):
            return None
        if (
            key_start == 0
            and keys == self.position
            and (self.window is None or keys <= self.window)
        ):
            return "causal"  # bottom-right aligned: the fused kernel's own mask
        q_pos = mx.arange(self.position - queries, self.position)[:, None]
        k_pos = mx.arange(key_start, key_start + keys)[None]
        visible = q_pos >= k_pos
        if self.window is not None:
            visible = visible & (q_pos - k_pos < self.window)
        return visible

    @property
    def nbytes(self) -> int:
        """Bytes its buffers hold: the quantized parts, under a quantized cache."""
        return _nbytes(self.keys) + _nbytes(self.values)

    def arrays(self) -> list[mx.array]:
        if self.keys is None or self.values is None:
            return []
        return [*_parts(self.keys), *_parts(self.values)]

    def snapshot(self, prefix: str) -> Snapshot:
        """The used rows (a quantized cache's as their three parts: a file
        holds the quantized arrays, never a dequantized copy)."""
        if self.keys is None or self.values is None:
            return {}
        fill = self.fill
        return {
            **_snap(_map(self.keys, lambda a: a[:, :, :fill]), f"{prefix}.keys"),
            **_snap(_map(self.values, lambda a: a[:, :, :fill]), f"{prefix}.values"),
            f"{prefix}.base": mx.array(self.base),
        }

    def restore(self, snapshot: Snapshot, prefix: str) -> None:
        if f"{prefix}.keys" not in snapshot:
            self.reset()
            return
        self.keys = _unsnap(snapshot, f"{prefix}.keys", self.quant)
        self.values = _unsnap(snapshot, f"{prefix}.values", self.quant)
        self.base = int(snapshot[f"{prefix}.base"].item())
        self.fill = self.keys.shape[2]


class KVComponent(LayeredComponent[LayerKV]):
    """The attention KV state of a group of layers (full, or all sliding-window).

    Rewindable without limit when full; within the ring's headroom when windowed.
    """

    # Parks by reference, rewinds, snapshots to arrays and merges into a batch.
    CAPABILITIES = Capabilities(swappable=True, rewindable=True, persistable=True, batchable=True)
    # A windowed ring rewinds exactly only within its headroom.
    WINDOWED = replace(CAPABILITIES, rewindable="window")

    def __init__(self, num_layers: int, window: int | None = None, headroom: int = 0):
        name = "kv" if window is None else "window"
        super().__init__(name, [LayerKV(window, headroom) for _ in range(num_layers)])
        self.window = window
        self.headroom = headroom

    def quantize(self, quant: KVQuantization) -> None:
        """Store every layer's rows under *quant* from now on (a fresh
        component: :func:`quantize_kv`; rows already written stay as they are)."""
        assert all(layer.keys is None for layer in self.layers), "quantize a fresh component"
        for layer in self.layers:
            layer.quant = quant

    def at(self, position: int, capacity: int) -> None:
        """Every written layer holding ``capacity - 1`` rows of lazy zeros
        (never evaluated: no memory) in buffers of *capacity*, its last row
        at *position*, so the next step claims the last row without growing:
        a scratch state's stand-in cache for tracing a step at one capacity
        of the ladder (``Runner.warm_up``)."""
        for layer in self.layers:
            if layer.keys is None or layer.values is None:
                continue
            layer.keys, layer.values = (
                _map(rows, lambda a: mx.zeros((1, a.shape[1], capacity, a.shape[3]), a.dtype))
                for rows in (layer.keys, layer.values)
            )
            layer.fill = capacity - 1
            layer.base = position - layer.fill
        self._position = position

    @classmethod
    def adopt(
        cls, name: str, layers: list[LayerKV], window: int | None, headroom: int, position: int
    ) -> KVComponent:
        """A component made of existing *layers* at *position* (a row leaving a batch)."""
        component = cls(0, window, headroom)
        component.name = name
        component.layers = layers
        component._position = position
        return component

    @classmethod
    def merge(cls, parts: list[KVComponent]) -> BatchKV:
        """Several sessions' K/V as one batch (left-padded: see the module)."""
        first = parts[0]
        layers = [
            BatchLayerKV.merge([part.layers[i] for part in parts]) for i in range(len(first.layers))
        ]
        return BatchKV(first.name, layers, first.window, first.headroom)


@lru_cache(maxsize=16)
def padding_mask(left: tuple[int, ...], key_start: int, keys: int) -> mx.array:
    """A decode step's ``(B, 1, 1, keys)`` mask over the fetched columns
    ``key_start..``: True where a row's column is not padding (column >= its
    ``left``). Every layer of a step that fetched the same columns (all the
    global ones; all the windowed ones) gets the same array, so a step
    builds it once instead of twice a layer (the next step fetches one column
    more: earlier steps' masks age out of the cache)."""
    cols = mx.arange(key_start, key_start + keys)
    return (cols[None] >= mx.array(left)[:, None])[:, None, None, :]


@lru_cache(maxsize=16)
def first_rows(left: tuple[int, ...]) -> mx.array:
    """:meth:`BatchLayerKV.first_rows` for rows padded by *left*: made once
    while the batch's rows and padding stay the same (a host-made array of
    more than eight bytes made every step would cost a page migration on
    CUDA: :class:`~turbospark.layers.cuda.attention.Rows`)."""
    return mx.array(left, dtype=mx.int32)


class BatchLayerKV:
    """One attention layer's K/V for several sessions, left-padded (see the module)."""

    step = 256

    def __init__(
        self,
        window: int | None,
        headroom: int,
        keys: Rows | None,
        values: Rows | None,
        left: list[int],
        fill: int,
        quant: KVQuantization | None = None,
    ) -> None:
        self.window = window
        self.headroom = headroom
        self.quant = quant  # the rows' setting: its sessions' (one runner's)
        self.keys = keys  # (B, kv_heads, capacity, dim); None until the first write
        self.values = values
        self.left = left
        self.fill = fill

    @classmethod
    def merge(cls, layers: list[LayerKV]) -> BatchLayerKV:
        """Right-align each session's retained rows in one new buffer with a
        step's headroom past them (so the first step writes in place): one copy
        of each session, proportional to its size. Sessions that have not run
        yet (fresh prompts prefilled together) merge into a batch whose buffers
        are allocated by the first write."""
        quant = layers[0].quant
        first = next((layer for layer in layers if layer.keys is not None), None)
        if first is None or first.keys is None or first.values is None:
            window, headroom = layers[0].window, layers[0].headroom
            return cls(window, headroom, None, None, [0] * len(layers), 0, quant)
        width = max(layer.fill for layer in layers)
        keys = _zeros(first.keys, len(layers), width + cls.step)
        values = _zeros(first.values, len(layers), width + cls.step)
        for row, layer in enumerate(layers):
            if layer.keys is not None and layer.values is not None and layer.fill:
                fill, cols = (
                    layer.fill,
                    (slice(row, row + 1), slice(None), slice(width - layer.fill, width)),
                )
                _assign(keys, cols, _map(layer.keys, lambda a, f=fill: a[:, :, :f]))
                _assign(values, cols, _map(layer.values, lambda a, f=fill: a[:, :, :f]))
        left = [width - layer.fill for layer in layers]
        return cls(first.window, first.headroom, keys, values, left, width, quant)

    @property
    def retain(self) -> int | None:
        return None if self.window is None else self.window - 1 + self.headroom

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)

    def arrays(self) -> list[mx.array]:
        if self.keys is None or self.values is None:
            return []
        return [*_parts(self.keys), *_parts(self.values)]

    def prepare(self, length: int) -> None:
        self._make_room(length)

    def _make_room(self, length: int) -> None:
        if self.keys is None or self.values is None or self.fill + length <= self.keys.shape[2]:
            return
        if self.retain is not None and self.fill > self.retain:
            # Columns no row's window can reach any more (the headroom is kept).
            drop, fill = self.fill - self.retain, self.fill
            self.keys = _map(self.keys, lambda a: a[:, :, drop:fill])
            self.values = _map(self.values, lambda a: a[:, :, drop:fill])
            self.left = [max(0, pad - drop) for pad in self.left]
            self.fill -= drop
        batch, fill = len(self.left), self.fill
        grow = -(-length // self.step) * self.step
        self.keys = _concat(
            _map(self.keys, lambda a: a[:, :, :fill]), _zeros(self.keys, batch, grow)
        )
        self.values = _concat(
            _map(self.values, lambda a: a[:, :, :fill]), _zeros(self.values, batch, grow)
        )

    def update(self, keys: mx.array, values: mx.array) -> tuple[int, int]:
        """Append ``(B, heads, L, dim)`` for every row (quantized first, under a
        quantized cache); return the buffer columns ``[start, stop)`` the new
        queries attend over (each row past its padding too: :meth:`mask`,
        :meth:`first_rows`)."""
        length = keys.shape[2]
        keys, values = quantize_rows(keys, self.quant), quantize_rows(values, self.quant)
        if self.keys is None or self.values is None:  # the first write of sessions merged fresh
            capacity = -(-length // self.step) * self.step
            self.keys = _zeros(keys, keys.shape[0], capacity)
            self.values = _zeros(values, values.shape[0], capacity)
        self._make_room(length)
        _assign(self.keys, (slice(None), slice(None), slice(self.fill, self.fill + length)), keys)
        _assign(
            self.values, (slice(None), slice(None), slice(self.fill, self.fill + length)), values
        )
        self.fill += length
        return _visible_from(self.window, self.fill, length), self.fill

    def first_rows(self) -> mx.array:
        """``(B,)`` int32 on the device: each row's first buffer column past
        its padding, what the attention kernels read for a batch's step
        (:class:`~turbospark.layers.cuda.attention.Rows`): one array for
        every layer and step while the rows' padding stays the same."""
        return first_rows(tuple(self.left))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Rows, Rows, int]:
        """:meth:`update`, then the visible columns and the index of the
        first one (for :meth:`mask`)."""
        start, fill = self.update(keys, values)
        return (
            _map(self.keys, lambda a: a[:, :, start:fill]),
            _map(self.values, lambda a: a[:, :, start:fill]),
            start,
        )

    def mask(self, queries: int, key_start: int, keys: int) -> mx.array | None:
        """``(B, 1, queries, keys)``: causal, within the window, and never padding.

        A decode step (one query, the last column) sees every fetched column
        causally, and :meth:`update_and_fetch` fetched only the window's, so
        its mask hides padding alone: None when no fetched column is padding
        (attention's unmasked kernel), else ``(B, 1, 1, keys)`` from a
        comparison with the rows' padding (:func:`padding_mask`: one array
        for every layer of a step that fetched the same columns)."""
        if queries == 1:
            if max(self.left) <= key_start:
                return None
            return padding_mask(tuple(self.left), key_start, keys)
        cols = mx.arange(key_start, key_start + keys)[None]  # (1, keys)
        q_cols = mx.arange(self.fill - queries, self.fill)[:, None]  # (queries, 1)
        visible = cols <= q_cols
        if self.window is not None:
            visible = visible & (q_cols - cols < self.window)
        left = mx.array(self.left)[:, None, None, None]  # (B, 1, 1, 1)
        return visible[None, None] & (cols[None, None] >= left)

    def extend(self, other: BatchLayerKV) -> None:
        """Append *other*'s rows. Both batches' used columns are written once
        into one new buffer, right-aligned, with a step's headroom past them,
        so the next decode step writes in place instead of copying it again."""
        if self.keys is None and other.keys is None:  # a layer nobody writes
            self.left = self.left + other.left
            return
        width = max(self.fill, other.fill)
        like = next(part for part in (self, other) if part.keys is not None)
        assert like.keys is not None and like.values is not None
        rows = len(self.left) + len(other.left)
        keys = _zeros(like.keys, rows, width + self.step)
        values = _zeros(like.values, rows, width + self.step)
        first = 0
        for part in (self, other):
            count, fill = len(part.left), part.fill
            if part.keys is not None and part.values is not None and fill:
                cols = (slice(first, first + count), slice(None), slice(width - fill, width))
                _assign(keys, cols, _map(part.keys, lambda a, f=fill: a[:, :, :f]))
                _assign(values, cols, _map(part.values, lambda a, f=fill: a[:, :, :f]))
            first += count
        self.left = [pad + width - self.fill for pad in self.left] + [
            pad + width - other.fill for pad in other.left
        ]
        self.keys, self.values, self.fill = keys, values, width

    def shift(self, offsets: list[int]) -> None:
        """Row ``i``'s columns ``offsets[i]`` to the right (one gather a buffer;
        see :class:`~turbospark.state.components.ShiftsRows`)."""
        self.left = [pad + offset for pad, offset in zip(self.left, offsets, strict=True)]
        if self.keys is None or self.values is None or not any(offsets):
            return
        capacity = _parts(self.keys)[0].shape[2]
        cols = mx.arange(capacity)[None] - mx.array(offsets)[:, None]  # (B, capacity)
        index = mx.clip(cols, 0, capacity - 1)[:, None, :, None]
        self.keys = _map(self.keys, lambda a: mx.take_along_axis(a, index, axis=2))
        self.values = _map(self.values, lambda a: mx.take_along_axis(a, index, axis=2))

    def filter(self, rows: list[int]) -> None:
        """Keep *rows*: one gather of their columns, the headroom past ``fill``
        kept, so the next step writes in place; padding every kept row has is
        dropped. Rows that are already a prefix are a slice, not a copy."""
        self.left = [self.left[row] for row in rows]
        if self.keys is None or self.values is None:
            return
        common = min(self.left)  # padding every remaining row has: drop it
        if rows == list(range(len(rows))):
            count = len(rows)
            self.keys = _map(self.keys, lambda a: a[:count, :, common:])
            self.values = _map(self.values, lambda a: a[:count, :, common:])
        else:
            index = mx.array(rows)
            self.keys = _map(self.keys, lambda a: a[index, :, common:])
            self.values = _map(self.values, lambda a: a[index, :, common:])
        self.left = [pad - common for pad in self.left]
        self.fill -= common

    def extract(self, row: int, position: int, back: int) -> LayerKV:
        """Row *row* as a one-row :class:`LayerKV` at *position*, its last *back*
        columns dropped."""
        layer = LayerKV(self.window, self.headroom, self.quant)
        if (
            self.keys is None or self.values is None
        ):  # never written (a layer that reads another's K/V)
            return layer
        end = self.fill - back
        begin = min(self.left[row], end)
        layer.keys = _map(self.keys, lambda a: mx.contiguous(a[row : row + 1, :, begin:end]))
        layer.values = _map(self.values, lambda a: mx.contiguous(a[row : row + 1, :, begin:end]))
        layer.fill = end - begin
        layer.base = position - layer.fill
        return layer


class BatchKV:
    """A :class:`~turbospark.state.kv.KVComponent` of several sessions: one
    :class:`BatchLayerKV` per layer."""

    def __init__(self, name: str, layers: list[BatchLayerKV], window: int | None, headroom: int):
        self.name = name
        self.layers = layers
        self.window = window
        self.headroom = headroom

    def __getitem__(self, index: int) -> BatchLayerKV:
        return self.layers[index]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.arrays()]

    def advance(self, n: int) -> None:
        del n  # positions are per row, kept by the rows themselves

    def extend(self, other: BatchedComponent) -> None:
        assert isinstance(other, BatchKV)
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.extend(theirs)

    def filter(self, rows: list[int]) -> None:
        for layer in self.layers:
            layer.filter(rows)

    def prepare(self, length: int) -> None:
        for layer in self.layers:
            layer.prepare(length)

    def shift(self, offsets: list[int]) -> None:
        for layer in self.layers:
            layer.shift(offsets)

    def hold(self) -> object:
        # After prepare() a step only writes columns past `fill`: the indices
        # are all it takes to undo it, and no buffer stays referenced.
        return [(list(layer.left), layer.fill) for layer in self.layers]

    def rollback(self, held: object) -> None:
        assert isinstance(held, list)
        for layer, (left, fill) in zip(self.layers, held, strict=True):
            layer.left, layer.fill = left, fill

    def extract(self, row: int, position: int, back: int, held: object | None) -> KVComponent:
        del held  # rewindable: a row going back drops its last columns
        layers = [layer.extract(row, position, back) for layer in self.layers]
        return KVComponent.adopt(self.name, layers, self.window, self.headroom, position)
