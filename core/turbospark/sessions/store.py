"""The session store: the live session, the parked pool and its disk tier, as one.

Every move of a session between memory tiers happens here: checking one out
to a request and back in, parking and promoting (the reuse rules of
:mod:`turbospark.sessions.reuse`), evicting under the slot and byte bounds,
writing to and reading from the session directory. So the counters that say
what was lost (``evicted``, ``disk_losses``) and the views of what is held
(:meth:`SessionStore.sessions`) have one owner.

The store never runs the model: a fresh state and the family's snapshot and
restore hooks come in as :class:`StateHooks`, from the runner that owns the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from turbospark.contract.hookspecs import FamilySpec
from turbospark.policies.steering import SteeringPolicy
from turbospark.sessions.disk_tier import DiskTier
from turbospark.sessions.pool import SessionPool
from turbospark.sessions.reuse import ReuseReason, ReuseReport, plan_reuse, plan_share
from turbospark.sessions.session import Session, SessionSnapshot
from turbospark.sessions.session_file import ModelIdentity
from turbospark.state.components import Snapshot, State

MAX_CHECKPOINTS = 4  # per session: two a turn (generation prompt, prompt end), two turns back


@dataclass(frozen=True)
class StateHooks:
    """The model work a store needs: a fresh, empty state, and a state's arrays
    out and back in (the family's ``turbospark_snapshot_state`` and
    ``turbospark_restore_state``)."""

    new_state: Callable[[], State]
    snapshot: Callable[[State], dict[str, Snapshot]]
    restore: Callable[[State, dict[str, Snapshot]], None]


@dataclass(frozen=True)
class DiskOptions:
    """Where a store's disk tier lives and what it may hold (``session_dir``)."""

    root: Path
    model: ModelIdentity
    context_length: int
    max_bytes: int | None


class SessionStore:
    """The live session, ``slots - 1`` parked ones (a pool only when ``slots > 1``)
    and, with *disk*, the directory sessions leaving memory are written to.

    *steering* is the runner's default: the one its disk files are written
    under, and the one each new conversation starts under until a request
    asks for its own (:meth:`request`)."""

    def __init__(
        self,
        hooks: StateHooks,
        spec: FamilySpec,
        *,
        slots: int,
        max_parked_bytes: int | None,
        steering: SteeringPolicy,
        disk: DiskOptions | None = None,
    ) -> None:
        self._hooks = hooks
        self._spec = spec
        self._rigid = [c.name for c in spec.components if c.rewindable is False]
        self.default_steering = steering
        self.requested = steering  # the steering of the next prompt (Runner.use_steering)
        self.live = self.new_session()
        self.pool = (
            SessionPool([self.new_session() for _ in range(slots - 1)], max_parked_bytes)
            if slots > 1
            else None
        )
        self.reuse_enabled = False
        self.evicted = False  # the last reset or swap discarded a parked session's content
        self.checked_out: list[Session] = []  # sessions requests hold (checkout, checkin)
        self.last_reuse = ReuseReport(
            kept=0, swapped=False, reason=ReuseReason.NO_HISTORY, detail="no prompt yet"
        )
        if disk is not None and self.pool is not None:
            self.pool.disk = DiskTier(
                disk.root,
                disk.model,
                components=[c.name for c in spec.components],
                context_length=disk.context_length,
                max_bytes=disk.max_bytes,
                capture=self.snapshot,
                materialize=self._materialize,
                resident=self.resident,
            )

    def new_session(self) -> Session:
        """An empty session, under the steering the next request asked for."""
        return Session(self._hooks.new_state(), steering=self.requested)

    # -- what is held ------------------------------------------------------------

    @property
    def pool_size(self) -> int:
        """Slots including the live one (1 when there is no pool)."""
        return 1 if self.pool is None else len(self.pool.parked) + 1

    def sessions(self) -> list[Session]:
        """The live session, then the parked slots."""
        return [self.live, *([] if self.pool is None else self.pool.parked)]

    @property
    def max_parked_bytes(self) -> int | None:
        return None if self.pool is None else self.pool.max_bytes

    def resident(self) -> set[str]:
        """Files whose session is in memory: live, parked, or checked out to a request."""
        sessions = (*self.sessions(), *self.checked_out)
        return {s.disk_name for s in sessions if s.disk_name is not None}

    # -- choosing the live session -----------------------------------------------

    def request(self, steering: SteeringPolicy) -> None:
        """The next prompt runs under *steering* (already checked against the model)."""
        self.requested = steering
        if not self.live.has_content:
            self.live.steering = steering

    def try_reuse(self, tokens: Sequence[int], vision_active: bool) -> int:
        """How many leading *tokens* are in the (possibly swapped-in) live session
        once the swap or rewind is committed; ``last_reuse`` says why."""
        prompt = list(tokens)
        if not self.reuse_enabled:
            self.last_reuse = ReuseReport(
                kept=0,
                swapped=False,
                reason=ReuseReason.DISABLED,
                detail="prefix reuse is off; runner.set_prefix_reuse(True) turns it on",
                prompt_tokens=len(prompt),
            )
        else:
            self.live, report = plan_reuse(
                self.live, self.pool, prompt, self._spec, vision_active, self.requested
            )
            if report.swapped and self.pool.trim():
                report = report.model_copy(update={"evicted": True})
            self.last_reuse = report
        self.evicted = self.last_reuse.evicted
        return self.last_reuse.kept

    def share(self, tokens: Sequence[int], vision_active: bool) -> int:
        """Seed the fresh live session with the longest opening of *tokens* a
        parked conversation holds; the tokens now in state (0: nothing shared)."""
        if not self.reuse_enabled:
            return 0
        report = plan_share(self.live, self.pool, list(tokens), vision_active, self.requested)
        if report is None:
            return 0
        self.last_reuse = report
        return report.kept

    def reset(self) -> None:
        """Park the live conversation (evicting the LRU slot when full) if there
        is a pool, then clear the live session."""
        self.evicted = False
        if self.pool is not None and self.live.has_content:
            self.live, self.evicted = self.pool.rotate_lru(self.live)
            self.evicted = self.pool.trim() or self.evicted
        self.live.clear()
        self.live.steering = self.requested

    def checkpoint(self, session: Session | None = None) -> None:
        """*session*'s (None: the live one's) components that cannot rewind, held
        at its current position."""
        (session or self.live).checkpoint(self._rigid, MAX_CHECKPOINTS)

    # -- sessions as arrays --------------------------------------------------------

    def snapshot(self, session: Session | None = None) -> SessionSnapshot:
        """*session* (None: the live one) as arrays plus its record and checkpoints."""
        session = session or self.live
        return SessionSnapshot(
            tokens=list(session.record.tokens),
            tainted=session.record.tainted,
            arrays=self._hooks.snapshot(session.state),
            checkpoints=tuple(session.checkpoints),
        )

    def restore(self, snapshot: SessionSnapshot, session: Session | None = None) -> None:
        """Make *session* (None: the live one) exactly what *snapshot* holds,
        its checkpoints included."""
        session = session or self.live
        self._hooks.restore(session.state, snapshot.arrays)
        session.load(snapshot, arrays_loaded=True)

    def _materialize(self, snapshot: SessionSnapshot) -> Session:
        """A new session holding *snapshot* (a loaded session file)."""
        session = Session(self._hooks.new_state(), steering=self.default_steering)
        self.restore(snapshot, session)
        return session

    # -- requests' sessions ---------------------------------------------------------

    def checkout(self) -> Session:
        """Hand the live session to a request; a fresh, empty one takes its place."""
        session, self.live = self.live, self.new_session()
        self.checked_out.append(session)
        return session

    def fork(self, session: Session) -> Session:
        """A new session holding *session*'s state by reference, neither live nor parked."""
        forked = Session(self._hooks.new_state())
        forked.load(session.held())
        return forked

    def checkin(self, session: Session) -> bool:
        """*session* becomes live again and the live one is parked (the LRU rule,
        then the memory cap, decide what goes). True if content was discarded."""
        if session in self.checked_out:
            self.checked_out.remove(session)
        # The request is over: nothing takes its last step back, so the state
        # from before that step (held by reference for that) is let go.
        session.undo = None
        evicted = False
        if self.live.has_content:
            if self.pool is None:
                evicted = True
            else:
                promoted, evicted = self.pool.rotate_lru(self.live)
                promoted.clear()
                evicted = self.pool.trim() or evicted
        self.live = session
        return evicted

    def holding(self, tokens: Sequence[int]) -> Session | None:
        """The warm session (live or parked) whose record shares the longest
        opening with *tokens*, or None when none shares any."""
        best = max(self.sessions(), key=lambda s: s.record.common_prefix(tokens))
        return best if best.record.common_prefix(tokens) else None

    def keep(self, session: Session, seconds: float | None) -> None:
        """Keep *session* in memory at least *seconds* more (None: for good),
        if the pool allows: it is evicted only after every slot not so kept."""
        session.keep_until = float("inf") if seconds is None else time.monotonic() + seconds

    def drop(self, session: Session) -> None:
        """Clear *session* and delete its file, on a client's request: it is gone
        from every tier, and nothing is counted as lost."""
        disk = self.disk
        if disk is not None and session.disk_name is not None:
            disk.forget(session.disk_name)
        session.clear()

    def forget(self) -> None:
        """Clear the live session and every parked one."""
        for session in self.sessions():
            session.clear()

    # -- the disk tier ---------------------------------------------------------------

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier; the pool holds it, since sessions leaving memory go there."""
        return None if self.pool is None else self.pool.disk

    @property
    def disk_losses(self) -> int:
        """Session files deleted for the disk bound that were their conversation's only copy."""
        return 0 if self.disk is None else self.disk.evictions

    @contextmanager
    def without_disk(self) -> Iterator[None]:
        """The disk tier detached for a while: nothing read or written, and a
        session leaving memory meanwhile is dropped."""
        disk = self.disk
        if disk is None or self.pool is None:
            yield
            return
        self.pool.disk = None
        try:
            yield
        finally:
            self.pool.disk = disk

    def flush(self) -> int:
        """Write every warm session that changed since its last write; the number written."""
        return self._write_warm(everything=False)

    def close(self) -> None:
        """Write every warm session, then let go of the session directory."""
        disk = self.disk
        if disk is not None:
            self._write_warm(everything=True)
            disk.close()

    def _write_warm(self, everything: bool) -> int:
        disk = self.disk
        if disk is None:
            return 0
        dirty = [
            s
            for s in self.sessions()
            if s.has_content and not disk.is_saved(s) and (everything or not disk.backup_evicted(s))
        ]
        return sum(disk.save(s) for s in dirty)
