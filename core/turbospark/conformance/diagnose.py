"""Saying *what* leaked when a check fails: which component, which session.

A logits mismatch only says that something is wrong. These helpers look at
the sessions a runner holds and name the culprit: a component object shared
by two sessions (parking one changes the other), or a component whose
contents differ from a fresh run of the conversation it is supposed to hold.
The runner's sessions are read here and only here (the kit ships in the
core, beside the runner it inspects).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from turbospark.state import State

if TYPE_CHECKING:
    from turbospark.conformance.kit import FamilyKit
    from turbospark.runner import Runner


def fail(message: str) -> NoReturn:
    raise AssertionError(message)


def live_state(runner: Runner) -> State:
    return runner.session_states()[0]


def session_states(runner: Runner) -> list[tuple[str, State]]:
    """``(label, state)`` for the live session and every parked slot."""
    live, *parked = runner.session_states()
    return [("the live session", live), *((f"parked slot {i}", s) for i, s in enumerate(parked))]


def shared_components(sessions: Sequence[tuple[str, State]]) -> list[str]:
    """One line per component object that two sessions hold at once."""
    seen: dict[int, tuple[str, str]] = {}
    found = []
    for label, state in sessions:
        for name, component in state.items():
            key = id(component)
            if key in seen:
                first_label, first_name = seen[key]
                found.append(
                    f"component '{name}' of {label} is the same object as component "
                    f"'{first_name}' of {first_label}: parking one session changes the other"
                )
            else:
                seen[key] = (label, name)
    return found


def component_differences(kit: FamilyKit, state: State, reference: State) -> list[str]:
    """One line per component of *state* that differs from *reference*: position,
    then (for persistable components) the snapshot's keys, shapes and values."""
    found = []
    for name, component in state.items():
        ref = reference[name]
        if component.position != ref.position:
            found.append(
                f"component '{name}' is at position {component.position}, a fresh run of the "
                f"conversation is at {ref.position}"
            )
            continue
        if not kit.component(name).persistable:
            continue
        ours, theirs = component.snapshot(), ref.snapshot()
        if set(ours) != set(theirs):
            odd = sorted(set(ours) ^ set(theirs))
            found.append(
                f"component '{name}' has snapshot entries a fresh run lacks: {', '.join(odd)}"
            )
            continue
        for key in sorted(ours):
            a, b = np.asarray(ours[key]), np.asarray(theirs[key])
            if a.shape != b.shape:
                found.append(
                    f"component '{name}' entry '{key}' has shape {a.shape}, a fresh run {b.shape}"
                )
            elif not np.allclose(a, b, atol=kit.atol, rtol=kit.rtol):
                gap = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                found.append(
                    f"component '{name}' entry '{key}' differs from a fresh run by up to {gap:.3g}"
                )
    return found


def explain_session(
    kit: FamilyKit, runner: Runner, conversation: str, history: Sequence[int]
) -> str:
    """Why the live session, which should hold *conversation*, does not."""
    lines = shared_components(session_states(runner))
    lines += [
        f"{line} (in the live session, holding {conversation})"
        for line in component_differences(kit, live_state(runner), kit.fresh_state(history))
    ]
    if not lines:
        lines = ["no component differs from a fresh run: the forward itself diverged"]
    return "\n  - " + "\n  - ".join(lines)
