"""Per-session state: the component protocol and the shared attention KV components.

A session's state is a mapping ``component name -> StateComponent``. Components
are plain objects holding ``mx.array`` references, so parking a session in the
pool moves references and never copies memory. Families with other kinds of
state (recurrent matrices, conv tails) implement the same protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

import mlx.core as mx

from turbospark.errors import RewindError

if TYPE_CHECKING:
    from turbospark.batch import BatchKV

Snapshot = dict[str, mx.array]


@runtime_checkable
class StateComponent(Protocol):
    """What the runner needs from every piece of session state."""

    @property
    def position(self) -> int:
        """Number of tokens this component has consumed (the next write position)."""

    @property
    def nbytes(self) -> int:
        """Bytes held by this component's arrays right now (allocated, not just used)."""

    @property
    def max_safe_rewind(self) -> int:
        """How many tokens :meth:`rewind` can drop with exact results (0 if none)."""

    def reset(self) -> None:
        """Forget everything; position becomes 0."""

    def rewind(self, n: int) -> None:
        """Drop the last *n* tokens; raises :class:`RewindError` past ``max_safe_rewind``."""

    def arrays(self) -> list[mx.array]:
        """The live arrays, for ``mx.eval`` after a step."""

    def snapshot(self) -> Snapshot:
        """Arrays-only copy of the state (held references; MLX arrays are immutable)."""

    def restore(self, snapshot: Snapshot) -> None:
        """Become exactly the state that :meth:`snapshot` captured."""


State = dict[str, StateComponent]


def state_position(state: State) -> int:
    """The common position of every component (they advance together)."""
    positions = {c.position for c in state.values()}
    if len(positions) != 1:
        detail = ", ".join(f"{n}={c.position}" for n, c in state.items())
        raise RuntimeError(f"state components disagree on position ({detail})")
    return positions.pop()


def state_nbytes(state: State) -> int:
    return sum(c.nbytes for c in state.values())


def refuse_rewind(name: str, n: int, limit: int) -> RewindError:
    return RewindError(
        f"state component '{name}' can rewind at most {limit} token(s), asked for {n}; "
        "call reset() and prefill again instead"
    )


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


class LayerPart(Protocol):
    """One layer's share of a :class:`LayeredComponent`."""

    @property
    def nbytes(self) -> int: ...

    @property
    def max_safe_rewind(self) -> int: ...

    def reset(self) -> None: ...

    def rewind(self, n: int) -> None: ...

    def arrays(self) -> list[mx.array]: ...

    def snapshot(self, prefix: str) -> Snapshot: ...

    def restore(self, snapshot: Snapshot, prefix: str) -> None: ...


Part = TypeVar("Part", bound=LayerPart)


class LayeredComponent(Generic[Part]):
    """A state component made of one part per layer, advancing together.

    The family's forward updates each layer's part, then calls :meth:`advance`
    once; the component's position is therefore well defined even over zero
    layers (a config with no layer of this kind).
    """

    def __init__(self, name: str, layers: list[Part]) -> None:
        self.name = name
        self.layers = layers
        self._position = 0

    def __getitem__(self, index: int) -> Part:
        return self.layers[index]

    @property
    def position(self) -> int:
        return self._position

    def advance(self, n: int) -> None:
        """Called by the family once per forward, after every layer has run."""
        self._position += n

    def realign(self) -> None:
        """After a forward failed between its layers and :meth:`advance`: the layers
        that ran wrote past the component's position; take them back to it, so the
        next feed writes where the position says (a part that keeps no position of
        its own has nothing to take back)."""
        for layer in self.layers:
            ahead = getattr(layer, "position", self._position) - self._position
            if ahead > 0:
                layer.rewind(ahead)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def max_safe_rewind(self) -> int:
        return min((layer.max_safe_rewind for layer in self.layers), default=self._position)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self._position = 0

    def rewind(self, n: int) -> None:
        if n < 0 or n > self.max_safe_rewind:
            raise refuse_rewind(self.name, n, self.max_safe_rewind)
        for layer in self.layers:
            layer.rewind(n)
        self._position -= n

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.arrays()]

    def snapshot(self) -> Snapshot:
        snap = {"position": mx.array(self._position)}
        for i, layer in enumerate(self.layers):
            snap.update(layer.snapshot(str(i)))
        return snap

    def restore(self, snapshot: Snapshot) -> None:
        for i, layer in enumerate(self.layers):
            layer.restore(snapshot, str(i))
        self._position = int(snapshot["position"].item())


class KVComponent(LayeredComponent[LayerKV]):
    """The attention KV state of a group of layers (full, or all sliding-window).

    Rewindable without limit when full; within the ring's headroom when windowed.
    """

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
        """Several sessions' K/V as one batch (see :mod:`turbospark.batch`)."""
        from turbospark.batch import BatchKV, BatchLayerKV

        first = parts[0]
        layers = [
            BatchLayerKV.merge([part.layers[i] for part in parts]) for i in range(len(first.layers))
        ]
        return BatchKV(first.name, layers, first.window, first.headroom)
