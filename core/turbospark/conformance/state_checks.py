"""Checks on the family's state components, driven through its hooks directly.

Each check here calls ``turbospark_new_state`` / ``turbospark_forward`` itself,
so a failure is the family's, not the runner's. Per-component checks take the
``component`` fixture (one test per declared component); what a component
must do follows from its :class:`~turbospark.ComponentSpec`, never from
probing the object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import mlx.core as mx
import numpy as np
import pytest

from turbospark.conformance.diagnose import (
    component_differences,
    fail,
    live_state,
    no_component_differs,
    shared_below,
)
from turbospark.conformance.kit import FamilyKit
from turbospark.errors import RewindError
from turbospark.state.components import Snapshot, State, StateComponent, state_nbytes

CHUNK = 96  # long prompts are fed in chunks, so growing buffers drop and reallocate
SHORT = 16  # prompt length for components that keep every token


def feed_in_chunks(kit: FamilyKit, state: State, tokens: Sequence[int], start: int) -> None:
    for offset in range(0, len(tokens), CHUNK):
        kit.forward(state, tokens[offset : offset + CHUNK], start + offset, "none")


def explain_state(kit: FamilyKit, state: State, history: Sequence[int]) -> str:
    """The per-entry report of *state* against a fresh run of *history*."""
    found = component_differences(kit, state, kit.fresh_state(history))
    return "what differs: " + ("; ".join(found) or no_component_differs(kit, kit.model))


def array_bytes(component: StateComponent) -> int:
    return sum(a.nbytes for a in component.arrays())


def return_others_to(
    kit: FamilyKit, state: State, component: str, held: dict[str, Snapshot], back: int
) -> None:
    """Put every component but *component* back *back* tokens: restore its
    snapshot when *held* has one (exact), else rewind it, else skip the check."""
    for name, other in state.items():
        if name == component:
            continue
        if name in held:
            other.restore(held[name])
        elif kit.component(name).rewindable is not False and other.max_safe_rewind >= back:
            other.rewind(back)
        else:
            pytest.skip(
                f"'{name}' can neither rewind {back} token(s) nor be restored from a snapshot, "
                f"so '{component}' cannot be tested alone"
            )


def expect_refused_rewind(component: StateComponent, name: str, n: int) -> None:
    """``rewind(n)`` past ``max_safe_rewind`` must raise and change nothing."""
    position = component.position
    try:
        component.rewind(n)
    except RewindError:
        pass
    else:
        fail(
            f"'{name}' accepted rewind({n}) with max_safe_rewind {component.max_safe_rewind}; "
            "it must raise RewindError"
        )
    if component.position != position:
        fail(f"a refused rewind({n}) moved '{name}' from {position} to {component.position}")


class StateChecks:
    """Declaration, accounting, reset, rewind, snapshot and chunking of the state."""

    long_prompt = 300
    """Prompt length for ``rewindable="window"`` components: long enough that a
    sliding-window ring has dropped rows before it is rewound or snapshotted."""

    def prompt_length(self, kit: FamilyKit, component: str) -> int:
        return self.long_prompt if kit.component(component).rewindable == "window" else SHORT

    @final
    def test_state_matches_declaration(self, kit: FamilyKit) -> None:
        """A fresh state holds exactly the declared components, each a
        :class:`~turbospark.state.components.StateComponent` at position 0, honestly sized,
        and sharing no mutable object or array with another fresh state or a
        reset one, anywhere below the components (a K/V list kept on the model
        object would make every "fresh" state one and the same)."""
        declared = [c.name for c in kit.spec.components]
        state, other = kit.new_state(), kit.new_state()
        if sorted(state) != sorted(declared):
            fail(
                f"turbospark_new_state returned components {sorted(state)}, but "
                f"turbospark_family declares {sorted(declared)}"
            )
        for name, component in state.items():
            if not isinstance(component, StateComponent):
                fail(
                    f"component '{name}' ({type(component).__name__}) lacks the "
                    "StateComponent protocol"
                )
            if component.position != 0:
                fail(f"component '{name}' of a fresh state is at position {component.position}")
        shared = shared_below(("one fresh state", state), ("another fresh state", other))
        if shared:
            fail("turbospark_new_state must build new objects every call: " + "; ".join(shared))
        undeclared = sorted(set(kit.swappable) - set(declared))
        if undeclared:
            fail(f"turbospark_pool_capability names undeclared component(s) {undeclared}")
        widened = [n for n in kit.swappable if not kit.component(n).swappable]
        if widened:
            fail(
                f"turbospark_pool_capability lists {widened} as swappable, but turbospark_family "
                "declares them not swappable (an arch may narrow the declaration, never widen it)"
            )
        before = state_nbytes(state)
        kit.forward(state, kit.tokens(1, SHORT), 0, "none")
        if state_nbytes(state) <= before:
            fail(
                f"the state holds {state_nbytes(state)} bytes after {SHORT} tokens, {before} fresh"
            )
        for each in state.values():
            each.reset()
        shared = shared_below(("a reset state", state), ("a new state", kit.new_state()))
        if shared:
            fail("reset() and turbospark_new_state must not share objects: " + "; ".join(shared))

    @final
    def test_model_keeps_no_conversation(self, kit: FamilyKit) -> None:
        """A new state on a model that has served another conversation gives the
        logits a new state on a freshly loaded model gives: the model object
        (which every session shares) keeps nothing of a conversation."""
        served, steps = kit.new_state(), 3
        kit.forward(served, kit.tokens(11, SHORT), 0, "none")
        for i, token in enumerate(kit.tokens(12, steps)):  # and a few decode steps
            kit.forward(served, [token], SHORT + i)
        prompt = kit.tokens(13, SHORT // 2)
        gap = kit.logits_gap(kit.forward(kit.new_state(), prompt, 0), kit.fresh_logits(prompt))
        if gap is not None:
            changes = kit.model_changes(kit.model)
            fail(
                f"a new state on a model that has served {SHORT + steps} tokens of another "
                f"conversation gives logits up to {gap:.3g} off a new state on a freshly loaded "
                "model: the model object keeps conversation state, which every session and "
                "every new state shares (keep it in a state component); "
                + (
                    "the model holds what a new one does not: " + "; ".join(changes)
                    if changes
                    else "nothing visible on the model object changed (a closure or a module global?)"
                )
            )

    @final
    def test_nbytes_honest(self, kit: FamilyKit, component: str) -> None:
        """``nbytes`` equals the bytes of the component's arrays, never shrinks
        as tokens arrive, and is back to a fresh component's after ``reset()``."""
        state = kit.new_state()
        comp = state[component]
        fresh_bytes, fresh_arrays = comp.nbytes, len(comp.arrays())
        sizes = []
        prompt = kit.tokens(2, 2 * SHORT)
        for start in (0, SHORT):
            kit.forward(state, prompt[start : start + SHORT], start, "none")
            if comp.nbytes != array_bytes(comp):
                fail(
                    f"component '{component}' reports nbytes {comp.nbytes} at position "
                    f"{comp.position} but its arrays() hold {array_bytes(comp)} bytes"
                )
            sizes.append(comp.nbytes)
        # A fresh state must stay fresh while another is written; else the
        # reset() verdict below would blame the wrong side.
        new = kit.new_state()[component]
        if new.position != 0 or new.nbytes != fresh_bytes or len(new.arrays()) != fresh_arrays:
            fail(
                f"a new state built after another took {2 * SHORT} tokens has component "
                f"'{component}' at position {new.position} holding {new.nbytes} bytes in "
                f"{len(new.arrays())} array(s); the first fresh one held {fresh_bytes} bytes in "
                f"{fresh_arrays}: turbospark_new_state hands out state another session writes "
                "(kept on the model object?)"
            )
        if not fresh_bytes <= sizes[0] <= sizes[1]:
            fail(
                f"component '{component}' nbytes went {fresh_bytes} -> {sizes[0]} -> {sizes[1]} "
                f"over 0, {SHORT}, {2 * SHORT} tokens: it must grow (or stay) with tokens"
            )
        for each in state.values():
            each.reset()
        if comp.position != 0 or comp.nbytes != fresh_bytes or len(comp.arrays()) != fresh_arrays:
            fail(
                f"component '{component}' after reset() is at position {comp.position} holding "
                f"{comp.nbytes} bytes in {len(comp.arrays())} array(s); a fresh one is at 0 "
                f"holding {fresh_bytes} bytes in {fresh_arrays}: reset() leaks state"
            )

    @final
    def test_reset_forgets_the_conversation(self, kit: FamilyKit) -> None:
        """After every component's ``reset()``, a new conversation's logits equal
        a fresh state's: nothing of the old one leaks into the new one."""
        state = kit.new_state()
        kit.forward(state, kit.tokens(3, SHORT), 0, "none")
        for component in state.values():
            component.reset()
        prompt = kit.tokens(4, SHORT // 2)
        gap = kit.logits_gap(kit.forward(state, prompt, 0), kit.fresh_logits(prompt))
        if gap is not None:
            found = component_differences(kit, state, kit.fresh_state(prompt))
            fail(
                f"after reset() a new conversation's logits differ from a fresh state's by up to "
                f"{gap:.3g}; what leaked across reset(): "
                + ("; ".join(found) or no_component_differs(kit, kit.model))
            )

    @final
    def test_rewind_then_refeed(self, kit: FamilyKit, component: str) -> None:
        """Rewinding a rewindable component and feeding different tokens equals an
        uninterrupted run of the new tokens; a non-rewindable one refuses honestly."""
        spec = kit.component(component)
        state = kit.new_state()
        comp = state[component]
        if spec.rewindable is False:
            kit.forward(state, kit.tokens(5, SHORT), 0, "none")
            if comp.max_safe_rewind != 0:
                fail(
                    f"'{component}' is declared not rewindable but reports max_safe_rewind "
                    f"{comp.max_safe_rewind}"
                )
            expect_refused_rewind(comp, component, 1)
            return
        length = self.prompt_length(kit, component)
        back = 4 if spec.rewindable == "window" else 6
        prompt, keep = kit.tokens(6, length), length - back
        feed_in_chunks(kit, state, prompt[:keep], 0)
        held = {
            name: other.snapshot()
            for name, other in state.items()
            if name != component and kit.component(name).persistable
        }
        kit.forward(state, prompt[keep:], keep, "none")
        if spec.rewindable is True and comp.max_safe_rewind != comp.position:
            fail(
                f"'{component}' is declared rewindable without limit but reports max_safe_rewind "
                f"{comp.max_safe_rewind} at position {comp.position}"
            )
        if comp.max_safe_rewind < back:
            fail(
                f"'{component}' is declared rewindable='window' but can rewind only "
                f"{comp.max_safe_rewind} token(s) after {length}; declare it not rewindable"
            )
        if comp.max_safe_rewind < comp.position:
            expect_refused_rewind(comp, component, comp.max_safe_rewind + 1)
        comp.rewind(back)
        return_others_to(kit, state, component, held, back)
        if comp.position != keep:
            fail(f"'{component}' is at {comp.position} after rewinding {back} from {length}")
        tail = kit.tokens(7, back + 2)
        history = prompt[:keep] + tail
        gap = kit.logits_gap(kit.forward(state, tail, keep), kit.fresh_logits(history))
        if gap is not None:
            fail(
                f"after rewinding '{component}' by {back} of {length} tokens and feeding "
                f"{len(tail)} different ones, logits differ from an uninterrupted run by up to "
                f"{gap:.3g}; " + explain_state(kit, state, history)
            )

    @final
    def test_snapshot_round_trip(self, kit: FamilyKit, component: str) -> None:
        """A persistable component's snapshot is arrays only, is not changed by
        later writes, and restoring it (in place or into a fresh state) resumes
        with the same logits."""
        if not kit.component(component).persistable:
            pytest.skip(f"not persistable: {component}")
        length = self.prompt_length(kit, component)
        prompt, keep = kit.tokens(8, length), length - 6
        state = kit.new_state()
        feed_in_chunks(kit, state, prompt[:keep], 0)
        held = {n: c.snapshot() for n, c in state.items() if kit.component(n).persistable}
        snap = held[component]
        for key, value in snap.items():
            if not isinstance(value, mx.array):
                fail(
                    f"snapshot of '{component}' holds {type(value).__name__} at '{key}', "
                    "not mx.array"
                )
        copies = {key: np.array(value) for key, value in snap.items()}
        expected = kit.forward(state, prompt[keep:], keep)
        back = length - keep + 3
        if all(c.max_safe_rewind >= back for c in state.values()):
            # Rewrite rows the snapshot covers: rewind into them, feed other tokens.
            for each in state.values():
                each.rewind(back)
            kit.forward(state, kit.tokens(10, back), length - back, "none")
        for key, value in snap.items():
            if not np.array_equal(np.array(value), copies[key]):
                fail(
                    f"snapshot of '{component}' changed when the state was written ('{key}'): it "
                    "aliases a buffer the forward writes in place"
                )
        state[component].restore(snap)
        return_others_to(kit, state, component, held, length - keep)
        if state[component].position != keep:
            fail(
                f"'{component}' restored from a snapshot at {keep} is at "
                f"{state[component].position}"
            )
        assert expected is not None
        gap = kit.logits_gap(kit.forward(state, prompt[keep:], keep), expected)
        if gap is not None:
            fail(
                f"restoring '{component}' from its snapshot at position {keep} and feeding the "
                f"same tokens again gives logits that differ by up to {gap:.3g}; "
                + explain_state(kit, state, prompt)
            )
        if len(held) == len(state):
            fresh = kit.new_state()
            for name, each in fresh.items():
                each.restore(held[name])
            gap = kit.logits_gap(kit.forward(fresh, prompt[keep:], keep), expected)
            if gap is not None:
                fail(
                    f"a fresh state restored from snapshots taken at {keep} (including "
                    f"'{component}') gives logits that differ by up to {gap:.3g}; "
                    + explain_state(kit, fresh, prompt)
                )

    @final
    def test_chunked_prefill_equals_sequential(self, kit: FamilyKit) -> None:
        """Token by token, one chunk, and uneven chunks give the same logits and
        the same state, and keep agreeing while decoding."""
        prompt = kit.tokens(9, 19)
        sequential = kit.open()
        for position, token in enumerate(prompt[:-1]):
            sequential.produce_prefill(token, position)
        runs = {"token by token": (sequential, sequential.produce(prompt[-1], len(prompt) - 1))}
        one = kit.open()
        runs["one chunk"] = (one, one.prefill_chunk(prompt, 0))
        uneven = kit.open()
        start = 0
        for size in (5, 1, 7, 6):
            logits = uneven.prefill_chunk(prompt[start : start + size], start)
            start += size
        runs["chunks of 5, 1, 7, 6"] = (uneven, logits)
        history = list(prompt)
        for step in range(3):
            reference = kit.fresh_logits(history)
            for label, (runner, out) in runs.items():
                gap = kit.logits_gap(out, reference)
                if gap is not None:
                    found = component_differences(kit, live_state(runner), kit.fresh_state(history))
                    fail(
                        f"prefill {label}, {step} decode step(s) in: logits differ from a fresh "
                        f"one-chunk run by up to {gap:.3g}; "
                        + ("; ".join(found) or no_component_differs(kit, runner.model))
                    )
            token = int(mx.argmax(reference).item())
            runs = {
                label: (runner, runner.produce(token, len(history)))
                for label, (runner, _) in runs.items()
            }
            history.append(token)
