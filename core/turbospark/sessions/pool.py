"""The pool of parked sessions: bounded by slots and bytes, least recently used first out.

Recency is a monotonic tick, not wall time, so behaviour is reproducible. An
empty slot is always the first to go. A session a client asked to keep
(``Session.keep_until``, Ollama's ``keep_alive``) goes only when every other
slot is kept too. A session leaving memory goes to the disk tier when there
is one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from turbospark.policies.steering import SteeringPolicy
from turbospark.sessions.disk_tier import DiskTier
from turbospark.sessions.session import Session


class SessionPool:
    """The ``session_slots - 1`` parked sessions beside the live one, the byte
    budget they must fit in (``None``: bounded by the slot count alone), and the
    disk tier that sessions leaving memory are written to (``None``: dropped)."""

    def __init__(
        self, parked: list[Session], max_bytes: int | None = None, disk: DiskTier | None = None
    ) -> None:
        self.parked = parked
        self.max_bytes = max_bytes
        self.disk = disk
        self._clock = 0

    @property
    def nbytes(self) -> int:
        return sum(session.nbytes for session in self.parked)

    def _eviction_order(self) -> list[Session]:
        """Parked sessions, first to go first: empty ones (a swap parks the empty
        live session as the newest, and rotating out a conversation instead
        would lose one that had a slot), then unkept ones, least recently used first."""
        now = time.monotonic()
        return sorted(self.parked, key=lambda s: (s.has_content, s.kept(now), s.tick))

    def trim(self) -> bool:
        """Clear least-recently-used parked sessions until the parked total fits
        ``max_bytes`` (their arrays are released); True if real content went."""
        dropped = False
        for session in self._eviction_order():
            if self.max_bytes is None or self.nbytes <= self.max_bytes:
                break
            dropped = self.lost_if_dropped(session) or dropped
            session.clear()
        return dropped

    def lost_if_dropped(self, session: Session) -> bool:
        """Whether dropping *session* from memory loses its content: not when the
        disk tier holds it (it is written now if it changed since its last write)."""
        return session.has_content and (self.disk is None or not self.disk.save(session))

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def best_match(
        self, prompt: Sequence[int], steering: SteeringPolicy | None = None
    ) -> tuple[int, int] | None:
        """``(index, score)`` of the parked session sharing the longest prefix
        with *prompt* (ties: most recently parked), or None if none shares any.
        With *steering*, only sessions built under that setting are scored."""
        best: tuple[int, int, int] | None = None
        for index, session in enumerate(self.parked):
            if steering is not None and session.steering != steering:
                continue
            score = session.record.common_prefix(prompt)
            if score and (best is None or (score, session.tick) > (best[1], best[2])):
                best = (index, score, session.tick)
        return None if best is None else best[:2]

    def swap(self, index: int, live: Session) -> Session:
        """Promote parked session *index*; park *live* in its place as the newest."""
        promoted = self.parked[index]
        self._park(live, index)
        return promoted

    def rotate_lru(self, live: Session) -> tuple[Session, bool]:
        """Park *live* in place of the least recently used slot (unkept first), which is
        returned to become live (the caller clears it); the flag says whether
        real content was lost (it held some, and no disk tier took it)."""
        promoted = self._eviction_order()[0]
        index = self.parked.index(promoted)
        self._park(live, index)
        return promoted, self.lost_if_dropped(promoted)

    def _park(self, session: Session, index: int) -> None:
        """*session* into slot *index*, as the newest. Its undo goes: a parked
        session has no last step to take back, and the references it held
        (the state before that step) would be a second copy of every
        non-rewindable component, pinned and counted nowhere."""
        session.undo = None
        session.tick = self._tick()
        self.parked[index] = session
