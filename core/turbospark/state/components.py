"""Per-session state: the component protocols (one session's, a batch's) and the layered base.

A session's state is a mapping ``component name -> StateComponent``. Components
are plain objects holding ``mx.array`` references, so parking a session in the
pool moves references and never copies memory. Families with other kinds of
state (recurrent matrices, conv tails) implement the same protocol.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar, runtime_checkable

import mlx.core as mx

from turbospark.errors import RewindError

Snapshot = dict[str, mx.array]


@dataclass(frozen=True)
class Capabilities:
    """What the runner may do with a kind of component, declared once on the
    component class that has the behaviour (its ``CAPABILITIES``), so a family's
    :class:`~turbospark.contract.hookspecs.ComponentSpec` cannot drift from it
    (``ComponentSpec.of``). The fields mean what ``ComponentSpec``'s do."""

    swappable: bool
    rewindable: bool | Literal["window"]
    persistable: bool
    batchable: bool = False
    traceable: bool = False


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


def distinct_nbytes(arrays: Iterable[mx.array]) -> int:
    """Bytes of *arrays*, each array object counted once.

    A snapshot or checkpoint holds references to the state's own arrays (MLX
    arrays are immutable, so taking one copies nothing): the same object held
    twice is one buffer, and counting it twice would evict warm sessions
    early. The objects are kept alive while counting, so no ``id`` is reused."""
    held = {id(a): a for a in arrays}
    return sum(a.nbytes for a in held.values())


def refuse_rewind(name: str, n: int, limit: int) -> RewindError:
    return RewindError(
        f"state component '{name}' can rewind at most {limit} token(s), asked for {n}; "
        "call reset() and prefill again instead"
    )


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


@runtime_checkable
class BatchedComponent(Protocol):
    """A component of several sessions merged along the batch axis."""

    @property
    def nbytes(self) -> int: ...

    def arrays(self) -> list[mx.array]: ...

    def advance(self, n: int) -> None:
        """Families call it once per forward; per-row positions live with the rows."""

    def extend(self, other: BatchedComponent) -> None:
        """Append *other*'s rows after this batch's rows."""

    def filter(self, rows: list[int]) -> None:
        """Keep only *rows*, in that order."""

    def prepare(self, length: int) -> None:
        """Make room for a step of *length* tokens now, so the step itself
        writes in place and :meth:`hold` needs no reference to a buffer that
        the step updates (a held buffer could not be donated: every step would
        copy it whole)."""

    def hold(self) -> object:
        """What a failed step needs to be undone, and a row going back needs to
        be extracted, taken before each step after :meth:`prepare`: indices,
        and references to arrays the step replaces rather than updates."""

    def rollback(self, held: object) -> None:
        """Become what :meth:`hold` returned (a step that failed midway)."""

    def extract(self, row: int, position: int, back: int, held: object | None) -> StateComponent:
        """A one-row component for *row*, whose next write position after
        dropping its last *back* tokens is *position* (copied, so the batch
        can be dropped). A component that cannot rewind reads a row going
        back from *held* (:meth:`hold`, taken before the step; None when
        nothing went back)."""


@runtime_checkable
class ShiftsRows(Protocol):
    """A batched component that can move a row along its columns: what lets
    prompts of different lengths go through one batched forward. Optional: a
    component without it (a recurrent state, which padding would advance) has
    its rows fed in equal lengths only."""

    def shift(self, offsets: list[int]) -> None:
        """Move row ``i``'s columns ``offsets[i]`` to the right (left when
        negative), its leading padding growing (shrinking) as much, so that
        padding a row fed past its last token is dropped and the row ends
        where every other row does. The columns past the end that a shift right
        pushes out are that padding; a shift left by as much restores the rest."""


@runtime_checkable
class PadsRows(Protocol):
    """A batched component whose layers can let padding pass without moving
    a row's state (a recurrent one: padding would advance it): the other way,
    beside :class:`ShiftsRows`, for prompts of different lengths to go through
    one batched forward."""

    def pad(self, lengths: list[int] | None) -> None:
        """The next forward feeds row ``i`` only ``lengths[i]`` real tokens, the
        rest padding past them, and must leave each row's state as after its
        own tokens; None: every token fed is real again."""
