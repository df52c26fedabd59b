"""Prefix reuse: which session serves a prompt, and how much of it is already in state.

:func:`plan_reuse` applies SEMANTICS.md's rules and commits the outcome
(swap, rewind or checkpoint restore). Every outcome, including every refusal,
is a :class:`ReuseReport` with its own reason, so a miss is never silent.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from turbospark.hookspecs import FamilySpec
from turbospark.pool import Checkpoint, Session, SessionPool


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


class ReuseReport(BaseModel):
    """What :meth:`Runner.try_reuse_prefix` decided: ``kept`` leading prompt tokens
    are in state, ``swapped`` says a parked session was promoted, ``reason`` why."""

    model_config = ConfigDict(frozen=True)

    kept: int
    swapped: bool
    reason: ReuseReason
    detail: str
    prompt_tokens: int = 0


def plan_reuse(
    live: Session,
    pool: SessionPool | None,
    prompt: Sequence[int],
    spec: FamilySpec,
    vision_active: bool,
) -> tuple[Session, ReuseReport]:
    """Choose and prepare the session for *prompt*; returns the (maybe new) live one."""

    def report(kept: int, reason: ReuseReason, detail: str) -> tuple[Session, ReuseReport]:
        return live, ReuseReport(
            kept=kept, swapped=swapped, reason=reason, detail=detail, prompt_tokens=len(prompt)
        )

    swapped = False
    if not prompt:
        return report(0, ReuseReason.EMPTY_PROMPT, "the prompt is empty")
    if pool is not None and not vision_active:
        # An image prompt may not select parked state: placeholder ids prove nothing.
        best = pool.best_match(prompt)
        if best is not None and best[1] > live.record.common_prefix(prompt):
            live = pool.swap(best[0], live)
            swapped = True

    keep = live.record.common_prefix(prompt)
    if keep == 0:
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
    live: Session, pool: SessionPool | None, prompt: Sequence[int], vision_active: bool
) -> ReuseReport | None:
    """Seed an empty live session with the longest prefix a parked one shares.

    Conversations that open alike (a chat template, a shared system prompt) need
    not recompute the opening: the donor's state is restored by reference into
    the live session and cut back to the shared prefix; the donor stays parked
    and unchanged (state arrays are never written in place once shared).
    """
    if pool is None or vision_active or live.has_content:
        return None
    best = pool.best_match(prompt)
    if best is None:
        return None
    donor = pool.parked[best[0]]
    target, checkpoint, _ = _reachable(donor, best[1])
    if target == 0:
        return None
    for name, component in live.state.items():
        component.restore(donor.state[name].snapshot())
    live.record.write(0, donor.record.tokens)
    live.checkpoints = list(donor.checkpoints)
    live.cut_to(target, checkpoint)
    return ReuseReport(
        kept=target,
        swapped=False,
        reason=ReuseReason.SHARED_PREFIX,
        detail=f"the first {target} token(s) are shared with a parked conversation, which "
        "stays parked; its state up to there was taken by reference",
        prompt_tokens=len(prompt),
    )


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
