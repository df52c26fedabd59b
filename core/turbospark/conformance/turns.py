"""One chat turn as a caller makes it, and the check that it was served right.

The caller contract (SEMANTICS.md), as the server runs it: ``kept =
try_reuse_prefix(prompt)``; if ``kept == 0``, ``reset()`` and ``kept =
share_prefix(prompt)`` (a parked conversation's shared opening); then feed
``prompt[kept:]`` from ``kept``. Every
session check is a script of such turns, and every turn's logits must equal a
fresh single-session run of that conversation's whole history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import mlx.core as mx

from turbospark.conformance.diagnose import explain_session
from turbospark.conformance.kit import FamilyKit
from turbospark.errors import TurbosparkError
from turbospark.generation.generate import acquire
from turbospark.generation.runner import Runner
from turbospark.sessions.reuse import ReuseReason


@dataclass(frozen=True)
class Turn:
    """What one turn did: the reuse decision, the eviction flag and the logits."""

    conversation: str
    prompt_tokens: int
    kept: int
    swapped: bool
    reason: ReuseReason
    evicted: bool
    logits: mx.array
    decoded: bool = False

    def describe(self) -> str:
        if self.decoded:
            return f"{self.conversation} (decoding at position {self.prompt_tokens - 1})"
        swap = ", after swapping in a parked session" if self.swapped else ""
        return (
            f"{self.conversation} ({self.prompt_tokens}-token prompt, kept {self.kept}{swap}, "
            f"reuse reason '{self.reason}')"
        )


def take_turn(runner: Runner, conversation: str, prompt: Sequence[int]) -> Turn:
    kept, report, evicted = acquire(runner, prompt)
    logits = runner.prefill_chunk(list(prompt[kept:]), kept)
    assert logits is not None
    return Turn(conversation, len(prompt), kept, report.swapped, report.reason, evicted, logits)


def check_turn(
    kit: FamilyKit, runner: Runner, turn: Turn, history: Sequence[int], context: str = ""
) -> None:
    """Fail, naming what leaked, unless *turn* matches a fresh run of *history*."""
    __tracebackhide__ = True  # a failure points at the check, not at the kit
    kit.check_apart(runner, f"{context}after {turn.describe()}: ")
    if runner.position != len(history):
        raise AssertionError(
            f"{context}after {turn.describe()} the live session is at position "
            f"{runner.position}, expected {len(history)}"
        )
    gap = kit.logits_gap(turn.logits, kit.fresh_logits(history))
    if gap is not None:
        raise AssertionError(
            f"{context}{turn.describe()}: logits differ from a fresh single-session run of "
            f"{turn.conversation}'s {len(history)}-token history by up to {gap:.3g}; what leaked:"
            + explain_session(kit, runner, turn.conversation, history)
        )


def decode(
    kit: FamilyKit, runner: Runner, turn: Turn, history: Sequence[int], context: str = ""
) -> list[int]:
    """Greedy-decode one token after *turn*, check its logits too; the new history."""
    __tracebackhide__ = True
    token = int(mx.argmax(turn.logits).item())
    logits = runner.produce(token, len(history))
    history = [*history, token]
    step = replace(turn, prompt_tokens=len(history), logits=logits, decoded=True)
    check_turn(kit, runner, step, history, context)
    return history


@dataclass(frozen=True)
class Step:
    """One turn of a script: *conversation* sends its history (cut to *keep*
    tokens when given: an edited or regenerated turn) plus *new* tokens."""

    conversation: str
    new: tuple[int, ...]
    keep: int | None = None

    def prompt(self, history: Sequence[int]) -> list[int]:
        kept = history if self.keep is None else history[: self.keep]
        return [*kept, *self.new]


def run_script(
    kit: FamilyKit,
    runner: Runner,
    steps: Sequence[Step],
    histories: dict[str, list[int]] | None = None,
    context: str = "",
) -> list[Turn]:
    """Play *steps* through the caller contract, decoding one token after each
    prompt; every prompt's and decode's logits are checked against a fresh run.
    *histories* (conversation -> tokens so far) is updated in place."""
    __tracebackhide__ = True
    histories = {} if histories is None else histories
    turns = []
    for index, step in enumerate(steps):
        prompt = step.prompt(histories.get(step.conversation, []))
        try:
            turn = take_turn(runner, step.conversation, prompt)
        except (TurbosparkError, RuntimeError) as exc:
            raise AssertionError(
                f"{context}turn {index + 1}: serving {step.conversation}'s {len(prompt)}-token "
                f"prompt raised {type(exc).__name__}: {exc}"
            ) from exc
        check_turn(kit, runner, turn, prompt, f"{context}turn {index + 1}: ")
        histories[step.conversation] = decode(
            kit, runner, turn, prompt, f"{context}turn {index + 1}: "
        )
        turns.append(turn)
    return turns
