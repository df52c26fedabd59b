"""Random schedules of turns across several conversations: no cross-talk, ever.

Hypothesis draws K conversations sharing a chat-template prefix, a pool size
and a schedule of turns (new turns, and edited ones that cut the history
back); each turn follows the caller contract and decodes one token. Every
prompt's and decode's logits must equal a fresh single-session run of that
conversation's whole history. A family without a pool is played with one
slot, where ``reset()`` alone keeps conversations apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from hypothesis import given
from hypothesis import strategies as st

from turbospark.conformance.kit import FamilyKit, kit_settings
from turbospark.conformance.turns import Step, run_script

NAMES = "ABC"
TEMPLATE = 3
MIN_TURNS, MAX_TURNS = 4, 8
MAX_NEW = 5


@dataclass(frozen=True)
class Schedule:
    slots: int
    steps: tuple[Step, ...]

    def __repr__(self) -> str:
        turns = ", ".join(
            f"{s.conversation}{'' if s.keep is None else f'[:{s.keep}]'}+{len(s.new)}"
            for s in self.steps
        )
        return f"Schedule(slots={self.slots}, turns: {turns})"


@st.composite
def schedules(draw: st.DrawFn, kit: FamilyKit, slot_choices: list[int]) -> Schedule:
    template = tuple(kit.tokens(0, TEMPLATE))
    count = draw(st.integers(2, len(NAMES)))
    lengths: dict[str, int] = {}  # history length after each turn (prompt + one decoded)
    steps = []
    for _ in range(draw(st.integers(MIN_TURNS, MAX_TURNS))):
        name = NAMES[draw(st.integers(0, count - 1))]
        new = tuple(
            draw(st.lists(st.integers(0, kit.arch.vocab_size - 1), min_size=1, max_size=MAX_NEW))
        )
        keep = None
        if name not in lengths:
            new = template + new
        elif draw(st.booleans()):
            keep = draw(st.integers(1, lengths[name] - 1))  # an edited turn: cut, then diverge
        base = lengths.get(name, 0) if keep is None else keep
        lengths[name] = base + len(new) + 1
        steps.append(Step(name, new, keep))
    return Schedule(draw(st.sampled_from(slot_choices)), tuple(steps))


class InterleavingChecks:
    """Property: K conversations over a pool never see each other's state."""

    @final
    def test_interleaved_conversations_never_cross_talk(self, kit: FamilyKit) -> None:
        """Every turn of every random schedule equals a fresh run of its own
        conversation; a failure names the turn, the session and the component."""
        slot_choices = [1] if kit.not_swappable else [2, 3, 1]  # shrinks toward a pool of 2

        @kit_settings(kit)
        @given(schedule=schedules(kit, slot_choices))
        def play(schedule: Schedule) -> None:
            context = f"{schedule!r}, "
            runner = kit.open(schedule.slots, context=context)
            run_script(kit, runner, schedule.steps, context=context)

        play()
