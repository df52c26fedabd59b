"""Attention K/V: one layer's, a group of layers' (a state component), and the batched forms.

A session's K/V grows in blocks and, for a sliding window, keeps a ring
(:class:`LayerKV`); :class:`KVComponent` is the component of a group of layers.

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
once. RoPE takes the per-row positions as an offset array.

Recurrent state (gated DeltaNet) needs no padding: its arrays are simply
concatenated (see :class:`turbospark.layers.gated_delta.state.GDNComponent`).

A component opts in with a ``merge(parts)`` classmethod returning a batched
component that offers ``extend``, ``filter`` and ``extract``
(:class:`~turbospark.state.components.BatchedComponent`), and its :class:`~turbospark.contract.hookspecs.ComponentSpec`
says ``batchable=True``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import mlx.core as mx

from turbospark.state.components import BatchedComponent, Capabilities, LayeredComponent, Snapshot


class LayerKV:
    """Keys and values of one attention layer, optionally limited to a sliding window.

    Buffers grow in ``step``-token blocks and are written in place (as mlx-lm's
    ``KVCache`` does), so decode never re-copies the history. A windowed layer
    keeps at least ``window - 1 + headroom`` recent tokens: ``window - 1`` are
    what the next query attends to, ``headroom`` is how far it can rewind.
    ``base`` is the absolute position of buffer row 0.
    """

    step = 256

    def __init__(self, window: int | None = None, headroom: int = 0):
        self.window = window
        self.headroom = headroom
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
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

    def _make_room(self, keys: mx.array, values: mx.array, length: int) -> None:
        """Room for *length* more rows (*keys* and *values* give the heads,
        widths and dtypes of new buffers)."""
        n_heads = keys.shape[1]
        if self.keys is not None and self.fill + length <= self.keys.shape[2]:
            return
        if self.keys is not None and self.retain is not None and self.fill > self.retain:
            # Drop rows the window can no longer reach (keeping the rewind headroom).
            drop = self.fill - self.retain
            self.keys = self.keys[:, :, drop : self.fill]
            self.values = self.values[:, :, drop : self.fill]
            self.base += drop
            self.fill -= drop
        grow = ((length + self.step - 1) // self.step) * self.step
        k_new = mx.zeros((1, n_heads, grow, keys.shape[3]), keys.dtype)
        v_new = mx.zeros((1, n_heads, grow, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = k_new, v_new
        else:
            self.keys = mx.concatenate([self.keys[:, :, : self.fill], k_new], axis=2)
            self.values = mx.concatenate([self.values[:, :, : self.fill], v_new], axis=2)

    def update(self, keys: mx.array, values: mx.array) -> tuple[int, int]:
        """Append ``(1, heads, L, dim)`` keys/values; return the buffer rows
        ``[start, stop)`` the new queries attend over (with the mask, for several)."""
        length = keys.shape[2]
        self._make_room(keys, values, length)
        self.keys[:, :, self.fill : self.fill + length] = keys
        self.values[:, :, self.fill : self.fill + length] = values
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
        start = 0
        if self.window is not None and length == 1:
            # Decode: only the last `window` rows are visible, so no mask is needed.
            start = max(0, self.fill - self.window)
        return start, self.fill

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, int]:
        """:meth:`update`, then those rows and the absolute position of the
        first one (for the mask)."""
        start, stop = self.update(keys, values)
        return self.keys[:, :, start:stop], self.values[:, :, start:stop], self.base + start

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
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def snapshot(self, prefix: str) -> Snapshot:
        if self.keys is None:
            return {}
        return {
            f"{prefix}.keys": self.keys[:, :, : self.fill],
            f"{prefix}.values": self.values[:, :, : self.fill],
            f"{prefix}.base": mx.array(self.base),
        }

    def restore(self, snapshot: Snapshot, prefix: str) -> None:
        if f"{prefix}.keys" not in snapshot:
            self.reset()
            return
        self.keys = snapshot[f"{prefix}.keys"]
        self.values = snapshot[f"{prefix}.values"]
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


class BatchLayerKV:
    """One attention layer's K/V for several sessions, left-padded (see the module)."""

    step = 256

    def __init__(
        self,
        window: int | None,
        headroom: int,
        keys: mx.array | None,
        values: mx.array | None,
        left: list[int],
        fill: int,
    ) -> None:
        self.window = window
        self.headroom = headroom
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
        first = next((layer for layer in layers if layer.keys is not None), None)
        if first is None:
            return cls(layers[0].window, layers[0].headroom, None, None, [0] * len(layers), 0)
        _, heads, _, dim = first.keys.shape
        width = max(layer.fill for layer in layers)
        shape = (len(layers), heads, width + cls.step, dim)
        keys, values = mx.zeros(shape, first.keys.dtype), mx.zeros(shape, first.keys.dtype)
        for row, layer in enumerate(layers):
            if layer.keys is not None and layer.fill:
                begin = width - layer.fill
                keys[row : row + 1, :, begin:width] = layer.keys[:, :, : layer.fill]
                values[row : row + 1, :, begin:width] = layer.values[:, :, : layer.fill]
        left = [width - layer.fill for layer in layers]
        return cls(first.window, first.headroom, keys, values, left, width)

    @property
    def retain(self) -> int | None:
        return None if self.window is None else self.window - 1 + self.headroom

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def prepare(self, length: int) -> None:
        self._make_room(length)

    def _make_room(self, length: int) -> None:
        if self.keys is None or self.fill + length <= self.keys.shape[2]:
            return
        if self.retain is not None and self.fill > self.retain:
            # Columns no row's window can reach any more (the headroom is kept).
            drop = self.fill - self.retain
            self.keys = self.keys[:, :, drop : self.fill]
            self.values = self.values[:, :, drop : self.fill]
            self.left = [max(0, pad - drop) for pad in self.left]
            self.fill -= drop
        batch, heads, _, dim = self.keys.shape
        grow = -(-length // self.step) * self.step
        zeros = mx.zeros((batch, heads, grow, dim), self.keys.dtype)
        self.keys = mx.concatenate([self.keys[:, :, : self.fill], zeros], axis=2)
        self.values = mx.concatenate([self.values[:, :, : self.fill], zeros], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, int]:
        """Append ``(B, heads, L, dim)`` for every row; return the visible columns
        and the index of the first one (for :meth:`mask`)."""
        length = keys.shape[2]
        if self.keys is None:  # the first write of sessions merged fresh
            batch, heads, _, dim = keys.shape
            capacity = -(-length // self.step) * self.step
            self.keys = mx.zeros((batch, heads, capacity, dim), keys.dtype)
            self.values = mx.zeros((batch, heads, capacity, dim), values.dtype)
        self._make_room(length)
        self.keys[:, :, self.fill : self.fill + length] = keys
        self.values[:, :, self.fill : self.fill + length] = values
        self.fill += length
        start = 0
        if self.window is not None and length == 1:
            start = max(0, self.fill - self.window)
        return self.keys[:, :, start : self.fill], self.values[:, :, start : self.fill], start

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
        parts = [part for part in (self, other) if part.keys is not None]
        _, heads, _, dim = parts[0].keys.shape
        rows = len(self.left) + len(other.left)
        shape = (rows, heads, width + self.step, dim)
        keys, values = mx.zeros(shape, parts[0].keys.dtype), mx.zeros(shape, parts[0].keys.dtype)
        first = 0
        for part in (self, other):
            count = len(part.left)
            if part.keys is not None and part.fill:
                begin = width - part.fill
                keys[first : first + count, :, begin:width] = part.keys[:, :, : part.fill]
                values[first : first + count, :, begin:width] = part.values[:, :, : part.fill]
            first += count
        self.left = [pad + width - self.fill for pad in self.left] + [
            pad + width - other.fill for pad in other.left
        ]
        self.keys, self.values, self.fill = keys, values, width

    def filter(self, rows: list[int]) -> None:
        """Keep *rows*: one gather of their columns, the headroom past ``fill``
        kept, so the next step writes in place; padding every kept row has is
        dropped. Rows that are already a prefix are a slice, not a copy."""
        self.left = [self.left[row] for row in rows]
        if self.keys is None:
            return
        common = min(self.left)  # padding every remaining row has: drop it
        if rows == list(range(len(rows))):
            self.keys = self.keys[: len(rows), :, common:]
            self.values = self.values[: len(rows), :, common:]
        else:
            index = mx.array(rows)
            self.keys = self.keys[index, :, common:]
            self.values = self.values[index, :, common:]
        self.left = [pad - common for pad in self.left]
        self.fill -= common

    def extract(self, row: int, position: int, back: int) -> LayerKV:
        """Row *row* as a one-row :class:`LayerKV` at *position*, its last *back*
        columns dropped."""
        layer = LayerKV(self.window, self.headroom)
        if self.keys is None:  # never written (a layer that reads another's K/V)
            return layer
        end = self.fill - back
        begin = min(self.left[row], end)
        layer.keys = mx.contiguous(self.keys[row : row + 1, :, begin:end])
        layer.values = mx.contiguous(self.values[row : row + 1, :, begin:end])
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
