"""The session store on its own: no model, no runner. A fake component stands
in for a family's state, so these tests hold that the store's moves (checkout,
checkin, park, promote, snapshot, restore) need nothing but its ``StateHooks``.
The runner-level rules are held in ``test_runner_sessions.py`` and
``test_seed_scenarios.py``."""

from __future__ import annotations

import mlx.core as mx
import pytest

from turbospark.contract.hookspecs import ArchConfig, ComponentSpec, FamilySpec
from turbospark.errors import InvalidInput, RewindError
from turbospark.policies import SteeringPolicy
from turbospark.sessions.reuse import ReuseReason
from turbospark.sessions.session import Checkpoint, Session
from turbospark.sessions.store import SessionStore, StateHooks


class Tape:
    """A component that only counts its tokens, rewindable by at most ``limit``."""

    def __init__(self, limit: int = 1 << 30) -> None:
        self.position = 0
        self.limit = limit

    @property
    def nbytes(self) -> int:
        return 4 * self.position

    @property
    def max_safe_rewind(self) -> int:
        return min(self.position, self.limit)

    def reset(self) -> None:
        self.position = 0

    def rewind(self, n: int) -> None:
        self.position -= n

    def arrays(self) -> list[mx.array]:
        return []

    def snapshot(self) -> dict[str, mx.array]:
        return {"n": mx.array(self.position)}

    def restore(self, snapshot: dict[str, mx.array]) -> None:
        self.position = int(snapshot["n"].item())


SPEC = FamilySpec(
    name="tape",
    model_types=["tape"],
    arch_config=ArchConfig,
    components=[
        ComponentSpec(
            name="tape", description="a counter", swappable=True, rewindable=True, persistable=True
        )
    ],
    state_source=__file__,
)
HOOKS = StateHooks(
    new_state=lambda: {"tape": Tape()},
    snapshot=lambda state: {name: c.snapshot() for name, c in state.items()},
    restore=lambda state, arrays: [c.restore(arrays[name]) for name, c in state.items()],
)


def store(slots: int, **options) -> SessionStore:
    made = SessionStore(
        HOOKS, SPEC, slots=slots, max_parked_bytes=None, steering=SteeringPolicy.off(), **options
    )
    made.reuse_enabled = True
    return made


def feed(session: Session, ids: list[int]) -> None:
    """What a forward does to a session: the state advances, the record follows."""
    start = session.position
    session.state["tape"].position += len(ids)
    session.record.write(start, ids)


def test_checkout_leaves_a_fresh_live_session_and_checkin_parks_the_one_before():
    s = store(slots=2)
    mine = s.checkout()
    assert s.live is not mine and not s.live.has_content and s.checked_out == [mine]
    feed(mine, [1, 2, 3])
    feed(s.live, [7, 8])  # another conversation went live meanwhile
    assert s.checkin(mine) is False  # the pool had room for it
    assert s.live is mine and s.checked_out == []
    assert [x.record.tokens for x in s.sessions()] == [[1, 2, 3], [7, 8]]


def test_without_a_pool_a_checkin_over_content_reports_the_loss():
    s = store(slots=1)
    mine = s.checkout()
    feed(s.live, [7, 8])
    assert s.checkin(mine) is True and s.pool is None and s.pool_size == 1


def test_reuse_promotes_the_parked_session_that_matches_and_parks_the_live_one():
    s = store(slots=3)
    feed(s.live, [1, 2, 3])
    s.reset()  # parked
    parked = next(x for x in s.pool.parked if x.has_content)
    feed(s.live, [4, 5])
    live = s.live
    kept = s.try_reuse([1, 2, 3, 9], vision_active=False)
    assert kept == 3 and s.last_reuse.swapped and s.live is parked
    assert live in s.pool.parked and s.evicted is False


def test_reuse_off_reports_why_and_moves_nothing():
    s = store(slots=2)
    s.reuse_enabled = False
    feed(s.live, [1, 2])
    live = s.live
    assert s.try_reuse([1, 2, 3], vision_active=False) == 0
    assert s.last_reuse.reason == ReuseReason.DISABLED and s.live is live


def test_snapshot_and_restore_go_through_the_hooks_with_the_record():
    s = store(slots=2)
    feed(s.live, [1, 2, 3])
    held = s.snapshot()
    s.reset()
    assert s.live.position == 0
    s.restore(held)
    assert s.live.position == 3 and s.live.record.tokens == [1, 2, 3]


def test_a_fork_holds_the_same_tokens_and_is_neither_live_nor_parked():
    s = store(slots=2)
    feed(s.live, [1, 2])
    forked = s.fork(s.live)
    assert forked.record.tokens == [1, 2] and forked.position == 2
    assert all(forked is not x for x in s.sessions())


def test_a_session_takes_back_a_lazy_step_and_nothing_else():
    session = Session({"tape": Tape()})
    feed(session, [1, 2])
    session.undo = Checkpoint(2, {})
    feed(session, [3])
    session.take_back()
    assert session.position == 2 and session.record.tokens == [1, 2] and session.undo is None
    with pytest.raises(InvalidInput, match="take_back"):
        session.take_back()


def test_a_rewind_past_a_component_limit_changes_nothing():
    session = Session({"tape": Tape(limit=1)})
    feed(session, [1, 2, 3])
    with pytest.raises(RewindError, match="'tape' at most 1"):
        session.rewind(2)
    assert session.position == 3 and session.record.tokens == [1, 2, 3]
    session.rewind(1)
    assert session.position == 2 and session.record.tokens == [1, 2]


def test_recovery_after_a_failed_forward_taints_the_record_and_puts_the_state_back():
    session = Session({"tape": Tape()})
    feed(session, [1, 2])
    before = Checkpoint(2, {})
    session.state["tape"].position += 3  # a forward that failed after writing
    session.recover(before)
    assert session.position == 2 and session.record.tainted


def test_a_kept_session_outlives_the_lru_rule_and_a_dropped_one_is_gone():
    s = store(slots=3)
    conversations = [[1, 2, 3], [4, 5], [6, 7], [8, 9]]
    feed(s.live, conversations[0])
    s.keep(s.holding([1, 2, 3, 0]), seconds=3600)
    for ids in conversations[1:]:
        s.reset()  # the oldest unkept slot goes, not the kept (and older) one
        feed(s.live, ids)
    held = sorted(x.record.tokens for x in s.sessions())
    assert held == [[1, 2, 3], [6, 7], [8, 9]]
    s.drop(s.holding([1, 2, 3, 0]))
    assert s.holding([1, 2, 3, 0]) is None
    forever, lapsed = s.holding([6, 7, 0]), s.holding([8, 9, 0])
    s.keep(forever, seconds=None)
    s.keep(lapsed, seconds=-1)  # already over: the LRU rule alone again
    assert forever.kept(float("1e300")) and not lapsed.kept(0.0 + lapsed.keep_until)


def admit(s: SessionStore, prompt: list[int]) -> Session:
    """What the engine does for a request: the best session made live (a new
    conversation parks the live one), then handed to the request."""
    if s.try_reuse(prompt, vision_active=False) == 0:
        s.reset()
    return s.checkout()


def test_conversations_as_many_as_slots_survive_their_turns_interleaved():
    """Three conversations, three slots, two next turns in flight together: the
    second swap parks the empty live session in its promoted one's slot,
    newest, and a check-in then rotates out a slot. The empty one goes first
    however recent, so the third conversation, parked and idle, is not lost."""
    s = store(slots=3)
    for opening in ([1, 2], [3, 4], [5, 6]):
        session = admit(s, opening)
        feed(session, opening)
        assert s.checkin(session) is False
    a = admit(s, [1, 2, 7])  # promoted; the third conversation parked in its slot
    b = admit(s, [3, 4, 8])  # promoted; the empty live session parked, newest
    assert (a.record.tokens, b.record.tokens) == ([1, 2], [3, 4])
    feed(a, [7])
    feed(b, [8])
    assert s.checkin(a) is False
    assert s.checkin(b) is False  # the empty slot rotated out, not [5, 6]
    held = sorted(x.record.tokens for x in s.sessions() if x.has_content)
    assert held == [[1, 2, 7], [3, 4, 8], [5, 6]]
