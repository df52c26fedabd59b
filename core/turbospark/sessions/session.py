"""A session: one conversation's whole state, its prefix record, its checkpoints and its undo.

A session puts itself back (a cut, a rewind, a taken-back step, a failed
forward's recovery), so every caller that undoes anything does it one way.
Parking and promoting move these objects between the live slot and the pool
(:mod:`turbospark.sessions.store`); nothing is ever copied.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from turbospark.errors import InvalidInput, RewindError, TurbosparkError
from turbospark.policies.steering import SteeringPolicy
from turbospark.sessions.prefix import PrefixRecord
from turbospark.state.components import (
    LayeredComponent,
    Snapshot,
    State,
    distinct_nbytes,
    state_position,
)

if TYPE_CHECKING:
    from turbospark.sessions.mtp_track import MtpTrack

# Conversation numbers: a count, never derived from content, so the sessions view
# (server/sessions.py) can follow a conversation without revealing anything of it.
_conversations = itertools.count(1)


@dataclass(frozen=True)
class Checkpoint:
    """Snapshots of a session's non-rewindable components at ``position``:
    held references to immutable arrays, so taking one costs no copy."""

    position: int
    snapshots: dict[str, Snapshot]

    def arrays(self) -> list[mx.array]:
        return [a for snap in self.snapshots.values() for a in snap.values()]


@dataclass(frozen=True)
class SessionSnapshot:
    """A whole session as arrays plus its record and checkpoints: what
    :meth:`Runner.snapshot` returns and what sharing an opening holds. The
    checkpoints travel with it, so a restored session can never resume from
    another conversation's recurrent state."""

    tokens: list[int]
    tainted: bool
    arrays: dict[str, Snapshot]
    checkpoints: tuple[Checkpoint, ...] = ()


@dataclass(eq=False)
class Session:
    state: State
    record: PrefixRecord = field(default_factory=PrefixRecord)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    tick: int = 0
    # The non-rewindable components as they were before the last token fed
    # speculatively (see take_back): held references, one step deep, let go
    # when the request ends or the session is parked (the store and the pool).
    undo: Checkpoint | None = None
    # Its file in the disk tier, if it has one (written by disk_store); a cleared
    # or reloaded session is a new conversation and must never overwrite it.
    disk_name: str | None = None
    # Which conversation this is: kept while it is parked, promoted, checked out,
    # extended or rewound; a new one on clear() or load(), the same rule as
    # disk_name. A number that vanishes from memory is a conversation that left it.
    conversation: int = field(default_factory=lambda: next(_conversations))
    # The steering its state is built under: part of its identity, so it is
    # only ever reused by a request asking for the same setting (reuse.py).
    steering: SteeringPolicy = field(default_factory=SteeringPolicy.off)
    # The MTP head's K/V and the hidden states it reads (DraftPolicies.mtp only):
    # derived from the state, so never parked or written; it follows cut_to.
    mtp: MtpTrack | None = None
    # Kept parked until this time.monotonic() (a client's keep_alive): the pool
    # evicts every other slot first. None: the least-recently-used rule alone.
    keep_until: float | None = None

    def kept(self, now: float) -> bool:
        """Whether a client asked to keep this conversation warm past *now*."""
        return self.keep_until is not None and self.keep_until > now

    @property
    def position(self) -> int:
        return state_position(self.state)

    @property
    def has_content(self) -> bool:
        return self.position > 0 or len(self.record) > 0

    def arrays(self) -> list[mx.array]:
        """Every array the session holds: its state's, its checkpoints', its
        undo's and its MTP track's. A checkpoint holds references, often to
        the very arrays the state holds (taken where the state still is) or
        another checkpoint's, so an array may appear more than once here."""
        held = [a for component in self.state.values() for a in component.arrays()]
        held += [a for checkpoint in self.checkpoints for a in checkpoint.arrays()]
        held += [] if self.undo is None else self.undo.arrays()
        return held + ([] if self.mtp is None else self.mtp.arrays())

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct arrays it holds (each buffer once): what the
        parked-memory cap, the pool's eviction and the sessions view count."""
        return distinct_nbytes(self.arrays())

    def clear(self) -> None:
        self.record.clear()
        self.checkpoints.clear()
        self.undo = None
        self.disk_name = None
        self.conversation = next(_conversations)
        self.mtp = None
        self.keep_until = None
        for component in self.state.values():
            component.reset()

    def held(self) -> SessionSnapshot:
        """This session by reference (MLX arrays are immutable, so nothing is copied)."""
        return SessionSnapshot(
            tokens=list(self.record.tokens),
            tainted=self.record.tainted,
            arrays={name: component.snapshot() for name, component in self.state.items()},
            checkpoints=tuple(self.checkpoints),
        )

    def load(self, snapshot: SessionSnapshot, arrays_loaded: bool = False) -> None:
        """Become *snapshot*: components (unless the caller already restored them
        through a family hook), record and checkpoints; nothing to undo."""
        if not arrays_loaded:
            for name, component in self.state.items():
                component.restore(snapshot.arrays[name])
        self.record.clear()
        self.record.write(0, snapshot.tokens, taint=snapshot.tainted)
        self.checkpoints = list(snapshot.checkpoints)
        self.undo = None
        self.disk_name = None
        self.conversation = next(_conversations)
        self.mtp = None
        self.keep_until = None

    def drop_checkpoints_after(self, position: int) -> None:
        self.checkpoints = [c for c in self.checkpoints if c.position <= position]

    def cut_to(self, position: int, held: Checkpoint | None = None) -> None:
        """Put the session back at *position*: components in *held* (a checkpoint
        or undo snapshot taken there) from their references, every other one by
        rewinding; the record and newer checkpoints follow."""
        snapshots = {} if held is None else held.snapshots
        for name, snapshot in snapshots.items():
            self.state[name].restore(snapshot)
        for component in self.state.values():
            if component.position > position:
                component.rewind(component.position - position)
        self.record.truncate(position)
        self.drop_checkpoints_after(position)
        if self.mtp is not None:
            self.mtp.cut(position)

    def parts(self, names: Sequence[str]) -> dict[str, Snapshot]:
        """Held references to the components *names* (those that cannot rewind):
        what a checkpoint or an undo keeps, at no copy."""
        return {name: self.state[name].snapshot() for name in names}

    def checkpoint(self, rigid: Sequence[str], limit: int) -> None:
        """Remember the components *rigid* at the current position (the newest
        *limit* are kept); none while the record cannot vouch for its ids."""
        snapshots = self.parts(rigid)
        if not snapshots or self.position == 0 or self.record.tainted:
            return
        self.drop_checkpoints_after(self.position - 1)
        self.checkpoints.append(Checkpoint(self.position, snapshots))
        del self.checkpoints[:-limit]

    def take_back(self) -> None:
        """Undo the last feed of a lazily sampled token (its id turned out a stop):
        the components in ``undo`` from their references, the rest rewind one
        token, and the record forgets the id."""
        undo = self.undo
        if undo is None or self.position != undo.position + 1:
            raise InvalidInput(
                "take_back() undoes the last produce() of a lazily sampled token, and the "
                "session has moved since (or never took one)"
            )
        self.cut_to(undo.position, undo)
        self.undo = None

    def rewind(self, back: int) -> None:
        """Rewind every component by *back*, all or nothing."""
        blocked = {n: c.max_safe_rewind for n, c in self.state.items() if c.max_safe_rewind < back}
        if blocked:
            limits = ", ".join(f"'{n}' at most {m}" for n, m in blocked.items())
            raise RewindError(
                f"a write {back} token(s) before the session's end needs a rewind this state cannot "
                f"make ({limits}); call try_reuse_prefix() or reset() and prefill again"
            )
        self.cut_to(self.position - back)

    def recover(self, before: Checkpoint) -> None:
        """After a forward failed midway: put the state back where it started, the
        components that cannot rewind from their references in *before*, the
        layers that ran ahead of their component's position taken back; or, when
        the components disagree even so, clear it. The record is tainted either way."""
        self.record.taint()
        self.undo = None
        try:
            for component in self.state.values():
                if isinstance(component, LayeredComponent):
                    component.realign()
            self.cut_to(before.position, before)
            self.position  # noqa: B018 -- raises if components now disagree
        except (TurbosparkError, RuntimeError):
            self.clear()
            self.record.taint()
