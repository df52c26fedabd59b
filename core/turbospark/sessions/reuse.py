"""Prefix reuse: which session serves a prompt, and how much of it is already in state.

:func:`plan_reuse` applies SEMANTICS.md's rules and commits the outcome
(swap, rewind or checkpoint restore). Every outcome, including every refusal,
is a :class:`ReuseReport` with its own reason, so a miss is never silent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from turbospark.contract.hookspecs import FamilySpec
from turbospark.policies.steering import SteeringPolicy
from turbospark.sessions.pool import SessionPool
from turbospark.sessions.session import Checkpoint, Session, SessionSnapshot


class ReuseReason(StrEnum):
    DISABLED = "disabled"  # prefix reuse is off
    EMPTY_PROMPT = "empty_prompt"
    NO_HISTORY = "no_history"  # the live session is empty and nothing parked matched
    TAINTED = "tainted"  # the live record cannot vouch for its ids (vision map, failed call)
    NO_MATCH = "no_match"  # the first token already differs
    EXTENDS = "extends"  # the whole record is a prefix of the prompt: nothing to rewind
    REWOUND = "rewound"  # rewound in place to the common prefix
    CHECKPOINT = "checkpoint"  # restored a prompt-boundary checkpoint of non-rewindable state
    NOT_REWINDABLE = "not_rewindable"  # a component cannot rewind at all (recurrent state)
    BEYOND_WINDOW = "beyond_window"  # the rewind exceeds a sliding-window ring's headroom
    SHALLOW_MATCH = "shallow_match"  # rewinding would destroy more than it keeps; park instead
    SHARED_PREFIX = "shared_prefix"  # after reset: the opening taken from a parked conversation
    RESTORED_FROM_DISK = "restored_from_disk"  # a session file scored best and was loaded
    FORKED = "forked"  # one of n completions: the first's prefilled state, by reference
    STEERING_CHANGED = "steering_changed"  # the matching state was built under other steering


class ReuseReport(BaseModel):
    """What :meth:`Runner.try_reuse_prefix` decided: ``kept`` leading prompt tokens
    are in state, ``swapped`` says a parked session was promoted, ``reason`` why."""

    model_config = ConfigDict(frozen=True)

    kept: int
    swapped: bool
    reason: ReuseReason
    detail: str
    prompt_tokens: int = 0
    evicted: bool = False  # a parked session with content was discarded to make room


def plan_reuse(
    live: Session,
    pool: SessionPool | None,
    prompt: Sequence[int],
    spec: FamilySpec,
    vision_active: bool,
    steering: SteeringPolicy | None = None,
) -> tuple[Session, ReuseReport]:
    """Choose and prepare the session for *prompt*; returns the (maybe new) live one.

    Only sessions built under *steering* (the request's setting) may serve it:
    steering changes every hidden state, so other sessions' state is not this
    prompt's state whatever their ids say (reason ``steering_changed``)."""

    def report(kept: int, reason: ReuseReason, detail: str) -> tuple[Session, ReuseReport]:
        return live, ReuseReport(
            kept=kept, swapped=swapped, reason=reason, detail=detail, prompt_tokens=len(prompt)
        )

    swapped = False
    steering = steering or SteeringPolicy.off()
    if not prompt:
        return report(0, ReuseReason.EMPTY_PROMPT, "the prompt is empty")
    live_score = live.record.common_prefix(prompt) if live.steering == steering else 0
    if pool is not None and not vision_active:
        # An image prompt may not select parked state: placeholder ids prove nothing.
        best = pool.best_match(prompt, steering)
        to_beat = max(live_score, 0 if best is None else best[1])
        if pool.disk is not None and pool.disk.model.steering == steering.identity:
            restored = _restore_from_disk(live, pool, prompt, to_beat)
            if restored is not None:
                return restored
        if best is not None and best[1] > live_score:
            donor = pool.parked[best[0]]
            target, checkpoint, _ = _reachable(donor, best[1])
            if target and donor.position - target > target:
                # Swapping it in would cut away more of the parked conversation than it
                # keeps: take its opening by reference instead and leave it intact.
                return _share_from_parked(live, pool, donor, target, checkpoint, prompt)
            live = pool.swap(best[0], live)
            swapped = True

    keep = live.record.common_prefix(prompt)
    if keep and live.steering != steering:
        return report(0, *_steering_changed(live, steering, keep))
    if keep == 0:
        other = None if pool is None or vision_active else pool.best_match(prompt)
        if other is not None and pool.parked[other[0]].steering != steering:
            return report(0, *_steering_changed(pool.parked[other[0]], steering, other[1]))
        if live.record.tainted:
            why = "a vision map is active" if vision_active else "its record is tainted"
            return report(0, ReuseReason.TAINTED, f"the live session cannot be reused: {why}")
        if len(live.record) == 0:
            return report(0, ReuseReason.NO_HISTORY, "no session holds any of this prompt")
        return report(
            0, ReuseReason.NO_MATCH, "the prompt shares no leading token with any session"
        )

    back = live.position - keep
    if back == 0:
        return report(
            keep, ReuseReason.EXTENDS, f"the session's {keep} tokens are a prefix of the prompt"
        )

    target, checkpoint, blockers = _reachable(live, keep)
    if target == 0:
        return report(0, *_refusal(spec, blockers, back))

    lost = live.position - target
    if pool is not None and not swapped and lost > target:
        return report(
            0,
            ReuseReason.SHALLOW_MATCH,
            f"only {target} token(s) match but reusing them would overwrite {lost} of the live "
            "conversation; it will be parked instead",
        )

    live.cut_to(target, checkpoint)
    if checkpoint is not None:
        return report(
            target,
            ReuseReason.CHECKPOINT,
            f"{', '.join(blockers)} cannot rewind {back} token(s); resumed from the prompt-boundary "
            f"checkpoint at {target} of {keep} matching tokens",
        )
    return report(
        target, ReuseReason.REWOUND, f"rewound {back} token(s) in place to the common prefix"
    )


def plan_share(
    live: Session,
    pool: SessionPool | None,
    prompt: Sequence[int],
    vision_active: bool,
    steering: SteeringPolicy | None = None,
) -> ReuseReport | None:
    """Seed an empty live session with the longest prefix a parked one shares.

    Conversations that open alike (a chat template, a shared system prompt) need
    not recompute the opening: the donor's state is restored by reference into
    the live session and cut back to the shared prefix; the donor stays parked
    and unchanged (state arrays are never written in place once shared).
    """
    if pool is None or vision_active or live.has_content:
        return None
    best = pool.best_match(prompt, steering or SteeringPolicy.off())
    if best is None:
        return None
    donor = pool.parked[best[0]]
    target, checkpoint, _ = _reachable(donor, best[1])
    if target == 0:
        return None
    _take_opening(live, donor.held(), target, checkpoint, donor.steering)
    return ReuseReport(
        kept=target,
        swapped=False,
        reason=ReuseReason.SHARED_PREFIX,
        detail=f"the first {target} token(s) are shared with a parked conversation, which "
        "stays parked; its state up to there was taken by reference",
        prompt_tokens=len(prompt),
    )


def _share_from_parked(
    live: Session,
    pool: SessionPool,
    donor: Session,
    target: int,
    checkpoint: Checkpoint | None,
    prompt: Sequence[int],
) -> tuple[Session, ReuseReport]:
    """A parked conversation shares only a shallow opening with *prompt*: park
    the live session (the LRU rule picks the slot it displaces, reported as an
    eviction when that slot held content) and start a fresh one from the
    donor's opening by reference, so the donor is never rewound in place."""
    held = donor.held()  # references survive even if the donor is the slot displaced
    evicted = False
    if live.has_content:
        live, evicted = pool.rotate_lru(live)
        evicted = pool.trim() or evicted
    live.clear()
    _take_opening(live, held, target, checkpoint, donor.steering)
    return live, ReuseReport(
        kept=target,
        swapped=False,
        reason=ReuseReason.SHARED_PREFIX,
        detail=f"a parked conversation matches the first {target} token(s) of its "
        f"{len(held.tokens)}; swapping it in would overwrite more than it keeps, so its "
        "opening was taken by reference and it stays parked",
        prompt_tokens=len(prompt),
        evicted=evicted,
    )


def _restore_from_disk(
    live: Session, pool: SessionPool, prompt: Sequence[int], to_beat: int
) -> tuple[Session, ReuseReport] | None:
    """Load the disk session that shares more of *prompt* than any session in
    memory (scored by its record alone), as a swap would promote a parked one.

    A file is only read when at least half of its session would be kept: a
    shallow match (a chat template's opening) is cheaper to take from a
    parked session by reference, or to prefill, than a whole file is to read.
    The loaded session becomes live and the live one is parked (the LRU slot
    it displaces goes to disk). A file whose content changed since it was
    indexed is scored again from what it holds. None: no file qualifies (a
    refused file is moved aside, logged, and the next candidate tried)."""
    assert pool.disk is not None
    for entry, score in pool.disk.candidates(prompt):
        if score <= to_beat:
            return None
        if len(entry.record) - score > score:
            continue
        started = time.perf_counter()
        session = pool.disk.load(entry)
        if session is None:
            continue
        # The file may hold other tokens than its index said (replaced since, and
        # re-indexed by load): the match is what the loaded session holds.
        score = session.record.common_prefix(prompt)
        if score <= to_beat or len(session.record) - score > score:
            continue
        target, checkpoint, _ = _reachable(session, score)
        if target == 0 or session.position - target > target:
            continue  # e.g. recurrent state with no checkpoint near the match
        seconds = time.perf_counter() - started
        evicted = False
        if live.has_content:
            displaced, evicted = pool.rotate_lru(live)
            displaced.clear()
            evicted = pool.trim() or evicted
        if target < session.position:
            session.cut_to(target, checkpoint)
        return session, ReuseReport(
            kept=target,
            swapped=False,
            reason=ReuseReason.RESTORED_FROM_DISK,
            detail=f"session file {entry.name} ({len(entry.record)} tokens, "
            f"{entry.nbytes:,} bytes) scored best and was loaded and verified in "
            f"{seconds * 1e3:.1f} ms; {target} token(s) kept"
            + (" from its prompt-boundary checkpoint" if checkpoint is not None else ""),
            prompt_tokens=len(prompt),
            evicted=evicted,
        )
    return None


def _take_opening(
    live: Session,
    held: SessionSnapshot,
    target: int,
    checkpoint: Checkpoint | None,
    steering: SteeringPolicy,
) -> None:
    """Load *held* into the empty *live* session and cut it back to *target*;
    it is now state built under the donor's *steering*."""
    live.load(held)
    live.steering = steering
    live.cut_to(target, checkpoint)


def _reachable(session: Session, keep: int) -> tuple[int, Checkpoint | None, dict[str, int]]:
    """Where *session* can be cut back to, at most *keep*: ``(target, checkpoint
    to restore or None, components that cannot rewind that far)``; target 0 = nowhere."""
    back = session.position - keep
    blockers = {n: c.max_safe_rewind for n, c in session.state.items() if c.max_safe_rewind < back}
    if not blockers:
        return keep, None, {}
    checkpoint = _usable_checkpoint(session, keep)
    return (0 if checkpoint is None else checkpoint.position), checkpoint, blockers


def _usable_checkpoint(live: Session, keep: int) -> Checkpoint | None:
    """The newest checkpoint at or below *keep* that every other component can rewind to."""
    for checkpoint in reversed(live.checkpoints):
        if not 0 < checkpoint.position <= keep:
            continue
        back = live.position - checkpoint.position
        others = (c for n, c in live.state.items() if n not in checkpoint.snapshots)
        if all(c.max_safe_rewind >= back for c in others):
            return checkpoint
    return None


def _steering_changed(
    session: Session, steering: SteeringPolicy, matched: int
) -> tuple[ReuseReason, str]:
    return (
        ReuseReason.STEERING_CHANGED,
        f"a session holds {matched} token(s) of this prompt but was built under steering "
        f"{session.steering.describe()}, and this request asks for {steering.describe()}; "
        "state built under one steering setting is never reused under another, so the "
        "prompt is prefilled again",
    )


def _refusal(spec: FamilySpec, blockers: dict[str, int], back: int) -> tuple[ReuseReason, str]:
    rigid = [name for name in blockers if spec.component(name).rewindable is False]
    if rigid:
        return (
            ReuseReason.NOT_REWINDABLE,
            f"{', '.join(rigid)} cannot rewind (the prompt diverges {back} token(s) before the "
            "session's end) and no checkpoint covers the match; the prompt is prefilled again",
        )
    limits = ", ".join(f"{name} at most {limit}" for name, limit in blockers.items())
    return (
        ReuseReason.BEYOND_WINDOW,
        f"a rewind of {back} token(s) exceeds the sliding-window headroom ({limits}); "
        "the prompt is prefilled again",
    )
