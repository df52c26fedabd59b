"""A session: one conversation's whole state, its prefix record and its checkpoints.

Parking and promoting move these objects between the live slot and the pool
(:mod:`turbospark.sessions.pool`); nothing is ever copied.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from turbospark.policies.steering import SteeringPolicy
from turbospark.sessions.prefix import PrefixRecord
from turbospark.state.components import Snapshot, State, state_nbytes, state_position

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

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for snap in self.snapshots.values() for a in snap.values())


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
    # speculatively (see Runner.take_back): held references, one step deep.
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

    @property
    def position(self) -> int:
        return state_position(self.state)

    @property
    def has_content(self) -> bool:
        return self.position > 0 or len(self.record) > 0

    @property
    def nbytes(self) -> int:
        extra = 0 if self.mtp is None else self.mtp.nbytes
        return state_nbytes(self.state) + sum(c.nbytes for c in self.checkpoints) + extra

    def clear(self) -> None:
        self.record.clear()
        self.checkpoints.clear()
        self.undo = None
        self.disk_name = None
        self.conversation = next(_conversations)
        self.mtp = None
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
