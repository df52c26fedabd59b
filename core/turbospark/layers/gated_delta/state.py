"""Gated DeltaNet's per-session state (:class:`GDNComponent`) and a traced pass's rebuildable states."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from turbospark.state.components import Capabilities, Snapshot, refuse_rewind

# -- the state ------------------------------------------------------------------

# A traced layer's state after its first n tokens (traced_layer, bound to the pass).
Rebuild = Callable[[int], tuple[mx.array, mx.array]]


@dataclass
class TracedPass:
    """A traced forward (a verify pass): where it started, how many tokens it
    fed, and per layer the ``(tail, recurrent)`` before it and the
    :data:`Rebuild` of its state after its first n tokens."""

    start: int
    layers: list[tuple[tuple[mx.array | None, mx.array | None], Rebuild] | None]
    length: int = 0


class GDNComponent:
    """Per linear layer: the conv tail ``(1, K-1, conv_dim)`` and the float32
    recurrent matrix ``(1, Hv, Dv, Dk)``.

    Arrays are replaced on every forward, never written in place, so a
    snapshot is a set of held references. Not rewindable: the decay and the
    delta-rule projection cannot be inverted, so dropping tokens means
    restoring a snapshot (or prefilling again). A fresh layer holds ``None``
    (zeros, allocated on first use), which keeps ``nbytes`` honest.

    Traceable: after :meth:`trace`, the next forward keeps every token's state,
    and :meth:`keep_traced` takes the one at the last accepted draft token.
    """

    name = "gdn"
    # Parks and snapshots by reference, merges into a batch, traces a verify pass.
    CAPABILITIES = Capabilities(
        swappable=True, rewindable=False, persistable=True, batchable=True, traceable=True
    )

    def __init__(self, num_layers: int):
        self._tails: list[mx.array | None] = [None] * num_layers
        self._states: list[mx.array | None] = [None] * num_layers
        self._position = 0
        self.tracing = False  # the next forward keeps every token's state (trace())
        self._traced: TracedPass | None = None  # the last traced forward's
        # (B,) int32: each row's real tokens in the next forward, the rest padding
        # past them (pad()); None: every token is real.
        self.valid: mx.array | None = None

    def layer(self, index: int) -> tuple[mx.array | None, mx.array | None]:
        return self._tails[index], self._states[index]

    def set_layer(self, index: int, tail: mx.array, recurrent: mx.array) -> None:
        self._tails[index] = tail
        self._states[index] = recurrent

    def set_layer_traced(
        self, index: int, tail: mx.array, recurrent: mx.array, rebuild: Rebuild
    ) -> None:
        """A traced forward's layer *index*: its state after the last token, and
        *rebuild* (n -> its state after the first n tokens, 1 or more)."""
        assert self._traced is not None, "set_layer_traced outside a traced forward"
        self._traced.layers[index] = (self.layer(index), rebuild)
        self.set_layer(index, tail, recurrent)

    def advance(self, n: int) -> None:
        """Called by the family once per forward, after every layer has run."""
        self._position += n
        if self.tracing:
            assert self._traced is not None
            self._traced.length, self.tracing = n, False

    # -- speculative rollback (turbospark.generation.speculation) -----------------------------

    def trace(self) -> None:
        """Keep the state after every token of the next forward (a verify pass)."""
        self.tracing = True
        self._traced = TracedPass(self._position, [None] * len(self._tails))

    def held_trace(self) -> TracedPass | None:
        """The last traced forward, for a :meth:`keep_traced` after later
        forwards (a chained round queued before this one was read)."""
        return self._traced

    def keep_traced(self, n: int, held: object | None = None) -> None:
        """Become the state after the first *n* tokens of the last traced forward,
        or of *held* (:meth:`held_trace`; anything fed after it leaves too); the
        trace is dropped. The last one kept whole: nothing to do (the state is
        current); none: the held references from before it; otherwise each
        layer's state there is built from the trace (one matmul, lazily)."""
        traced = self._traced if held is None else held
        assert traced is None or isinstance(traced, TracedPass)
        current = traced is self._traced
        self._traced = None
        if traced is None or not 0 <= n <= traced.length:
            length = 0 if traced is None else traced.length
            raise refuse_rewind(self.name, length - n, length)
        if not (current and n == traced.length):
            for i, layer in enumerate(traced.layers):
                assert layer is not None, f"layer {i} ran no traced forward"
                before, rebuild = layer
                self._tails[i], self._states[i] = before if n == 0 else rebuild(n)
        self._position = traced.start + n

    @property
    def position(self) -> int:
        return self._position

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    @property
    def max_safe_rewind(self) -> int:
        return 0

    def reset(self) -> None:
        self._tails = [None] * len(self._tails)
        self._states = [None] * len(self._states)
        self._position = 0
        self.tracing, self._traced = False, None

    def rewind(self, n: int) -> None:
        if n != 0:
            raise refuse_rewind(self.name, n, 0)

    def arrays(self) -> list[mx.array]:
        return [
            a for pair in zip(self._tails, self._states, strict=True) for a in pair if a is not None
        ]

    def snapshot(self) -> Snapshot:
        snap: Snapshot = {"position": mx.array(self._position)}
        for i, (tail, recurrent) in enumerate(zip(self._tails, self._states, strict=True)):
            if tail is not None:
                snap[f"{i}.conv_tail"] = tail
                snap[f"{i}.recurrent"] = recurrent
        return snap

    # -- batching: the rows of several sessions are simply concatenated ----------

    @classmethod
    def merge(cls, parts: list[GDNComponent]) -> GDNComponent:
        """Several sessions' layers stacked along the batch axis. A session that
        has not run yet (a fresh prompt prefilled beside others) holds None: it
        stacks as zeros, which is what the layer reads None as."""
        merged = cls(len(parts[0]._tails))
        for i in range(len(merged._tails)):
            merged._tails[i] = _stack([p._tails[i] for p in parts])
            merged._states[i] = _stack([p._states[i] for p in parts])
        return merged

    def extend(self, other: GDNComponent) -> None:
        for i in range(len(self._tails)):
            self._tails[i] = mx.concatenate([self._tails[i], other._tails[i]], axis=0)
            self._states[i] = mx.concatenate([self._states[i], other._states[i]], axis=0)

    def filter(self, rows: list[int]) -> None:
        index = mx.array(rows)
        self._tails = [None if tail is None else tail[index] for tail in self._tails]
        self._states = [None if state is None else state[index] for state in self._states]

    def prepare(self, length: int) -> None:
        del length  # every step replaces the arrays: nothing to make room for

    def pad(self, lengths: list[int] | None) -> None:
        """Padding past row ``i``'s first ``lengths[i]`` tokens leaves its state
        alone in the next forward (:class:`~turbospark.state.components.PadsRows`):
        the layers gate it out of the recurrence and take the conv tail at each
        row's own end."""
        self.valid = None if lengths is None else mx.array(lengths, dtype=mx.int32)

    def hold(self) -> object:
        return list(self._tails), list(self._states)

    def rollback(self, held: object) -> None:
        assert isinstance(held, tuple)
        self._tails, self._states = list(held[0]), list(held[1])

    def extract(self, row: int, position: int, back: int, held: object | None) -> GDNComponent:
        """Row *row* on its own; going *back* reads the references *held* before the step."""
        if back:
            assert isinstance(held, tuple), "a row going back needs the references held"
            tails, states = held
        else:
            tails, states = self._tails, self._states
        one = GDNComponent(len(self._tails))
        one._tails = [None if t is None else mx.contiguous(t[row : row + 1]) for t in tails]
        one._states = [None if s is None else mx.contiguous(s[row : row + 1]) for s in states]
        one._position = position
        return one

    def restore(self, snapshot: Snapshot) -> None:
        self.tracing, self._traced = False, None
        self._tails = [snapshot.get(f"{i}.conv_tail") for i in range(len(self._tails))]
        self._states = [snapshot.get(f"{i}.recurrent") for i in range(len(self._states))]
        self._position = int(snapshot["position"].item())


def _stack(parts: list[mx.array | None]) -> mx.array | None:
    """One-row arrays along the batch axis, None (all fresh) or zeros standing in
    for the fresh ones."""
    shaped = next((part for part in parts if part is not None), None)
    if shaped is None:
        return None
    return mx.concatenate([mx.zeros_like(shaped) if p is None else p for p in parts], axis=0)
