"""Checks on the session pool, through the runner as a caller uses it.

A family cannot implement the pool, but it can break it: a component shared
between sessions, a reset that leaks, a position that lies. These checks play
scripted conversations through the caller contract and compare every turn
with a fresh single-session run of that conversation.
"""

from __future__ import annotations

from typing import final

import numpy as np
import pytest

from turbospark.conformance.diagnose import fail, live_state
from turbospark.conformance.kit import FamilyKit
from turbospark.conformance.turns import Step, Turn, run_script
from turbospark.errors import SessionPoolUnsupported
from turbospark.generation.runner import Runner
from turbospark.sessions.reuse import ReuseReason

TEMPLATE = 3  # leading tokens every conversation shares, as a chat template's do


def conversation(kit: FamilyKit, seed: int, n: int) -> tuple[int, ...]:
    """A first prompt: the shared template, then *n* tokens of its own."""
    return (*kit.tokens(0, TEMPLATE), *kit.tokens(seed, n))


def unrelated(kit: FamilyKit, seed: int, n: int) -> tuple[int, ...]:
    """A first prompt sharing not even the template: the caller must ``reset()``."""
    first = (kit.tokens(0, 1)[0] + 1) % kit.arch.vocab_size
    return (first, *kit.tokens(seed, n - 1))


class PoolChecks:
    """Pool of one, refusal by name, shallow matches, resuming and eviction."""

    def no_pool_script(self, kit: FamilyKit) -> list[Step]:
        return [
            Step("A", conversation(kit, 30, 9)),
            Step("B", conversation(kit, 31, 7)),
            Step("C", unrelated(kit, 35, 6)),
            Step("A", tuple(kit.tokens(32, 4))),
            Step("A", tuple(kit.tokens(33, 5)), keep=TEMPLATE + 9),  # an edited turn
            Step("B", tuple(kit.tokens(34, 3))),
        ]

    @final
    def test_pool_of_one_is_a_no_op(self, kit: FamilyKit) -> None:
        """``session_slots`` 0 and 1 behave identically, bit for bit: same reuse
        decisions, no swap, no eviction, same logits, one session's bytes."""
        script = self.no_pool_script(kit)
        traces = {}
        for slots in (0, 1):
            runner = kit.open(slots)
            turns = run_script(kit, runner, script, context=f"session_slots={slots}, ")
            for index, turn in enumerate(turns):
                if turn.swapped or turn.evicted:
                    fail(
                        f"session_slots={slots}, turn {index + 1}: {turn.describe()} reports a "
                        f"swap or an eviction without a pool (evicted={turn.evicted})"
                    )
            if runner.session_pool_size != 1 or len(runner.session_nbytes()) != 1:
                fail(f"session_slots={slots} reports {runner.session_pool_size} session slots")
            traces[slots] = turns
        for index, (none, one) in enumerate(zip(traces[0], traces[1], strict=True)):
            same = (none.kept, none.reason) == (one.kept, one.reason)
            if not same or not np.array_equal(np.asarray(none.logits), np.asarray(one.logits)):
                fail(
                    f"turn {index + 1}: session_slots=1 differs from session_slots=0: "
                    f"{one.describe()} versus {none.describe()}"
                )

    @final
    def test_pool_refused_by_name(self, kit: FamilyKit) -> None:
        """A pool over state that cannot be parked is refused, naming every
        component that cannot and the file that defines the state."""
        if not kit.not_swappable:
            pytest.skip("every component is swappable")
        try:
            kit.open(2)
        except SessionPoolUnsupported as exc:
            message = str(exc)
        else:
            fail(
                f"Runner.open(session_slots=2) accepted a pool although "
                f"{', '.join(kit.not_swappable)} cannot be parked"
            )
        unnamed = [n for n in kit.not_swappable if n not in message]
        if unnamed or kit.spec.state_source not in message:
            fail(
                f"the refusal must name {', '.join(kit.not_swappable)} and "
                f"{kit.spec.state_source}; it says: {message}"
            )
        kit.open(1)  # without a pool the family still serves

    @final
    def test_shallow_match_refused_with_a_pool(self, kit: FamilyKit) -> None:
        """With a pool, a prompt that shares only the template with the live
        conversation is refused (kept 0) instead of overwriting it, and the live
        conversation, parked by ``reset()``, resumes intact."""
        kit.require_pool()
        runner = kit.open(2)
        histories: dict[str, list[int]] = {}
        run_script(kit, runner, [Step("A", conversation(kit, 40, 12))], histories)
        position = runner.position
        other = list(conversation(kit, 41, 10))
        back = position - TEMPLATE
        rewindable = all(c.max_safe_rewind >= back for c in live_state(runner).values())
        kept = runner.try_reuse_prefix(other)
        reason = runner.last_reuse.reason
        if kept != 0 or runner.position != position:
            fail(
                f"a prompt sharing only {TEMPLATE} template tokens with the live {position}-token "
                f"conversation kept {kept} and moved it to {runner.position} (reason '{reason}'); "
                "with a pool it must be refused and left intact"
            )
        if rewindable and reason != ReuseReason.SHALLOW_MATCH:
            fail(
                f"every component can rewind {back} tokens, so the refusal's reason must be "
                f"'shallow_match', not '{reason}'"
            )
        run_script(kit, runner, [Step("B", tuple(other))], histories)
        self._expect_resume(kit, runner, Step("A", tuple(kit.tokens(42, 4))), histories)

    def _expect_resume(
        self, kit: FamilyKit, runner: Runner, step: Step, histories: dict[str, list[int]]
    ) -> Turn:
        before = len(histories[step.conversation])
        (turn,) = run_script(kit, runner, [step], histories)
        if not turn.swapped or turn.kept != before:
            fail(
                f"{turn.describe()}: the parked {before}-token conversation {step.conversation} "
                "should have been swapped in and kept whole"
            )
        if turn.evicted:
            fail(f"{turn.describe()} reported an eviction")
        return turn

    @final
    def test_parked_sessions_resume_exactly(self, kit: FamilyKit) -> None:
        """Three conversations over three slots, interleaved: every second turn
        swaps its conversation back in whole, nothing is evicted, and every
        turn's logits equal a fresh run of that conversation alone."""
        kit.require_pool()
        runner = kit.open(3)
        histories: dict[str, list[int]] = {}
        first = [Step(name, conversation(kit, 50 + i, 6 + i)) for i, name in enumerate("ABC")]
        for turn in run_script(kit, runner, first, histories):
            if turn.evicted:
                fail(f"{turn.describe()} evicted a session while a slot was still free")
        for round_ in range(2):
            for i, name in enumerate("ABC"):
                new = tuple(kit.tokens(60 + 10 * round_ + i, 3 + i))
                self._expect_resume(kit, runner, Step(name, new), histories)

    @final
    def test_eviction_reported_only_for_real_content(self, kit: FamilyKit) -> None:
        """``session_slot_evicted()`` is true exactly when ``reset()`` discarded a
        parked conversation: never for a never-used slot or an empty live one."""
        kit.require_pool()
        runner = kit.open(3)

        def reset(expected: bool, why: str) -> None:
            runner.reset()
            if runner.session_slot_evicted() != expected:
                fail(f"session_slot_evicted() is {not expected} after a reset() that {why}")

        reset(False, "had nothing to park")
        histories: dict[str, list[int]] = {}
        for i, name in enumerate("ABC"):
            run_script(kit, runner, [Step(name, (i, *kit.tokens(70 + i, 8)))], histories)
            reset(
                name == "C",
                "parked "
                + ("over the oldest conversation, A" if name == "C" else "into a never-used slot"),
            )
        reset(False, "found an empty live session")
        (turn,) = run_script(kit, runner, [Step("A", tuple(kit.tokens(73, 3)))], histories)
        if turn.kept or turn.swapped:
            fail(f"{turn.describe()}: conversation A was evicted, yet something was reused")
        self._expect_resume(kit, runner, Step("B", tuple(kit.tokens(74, 2))), histories)
