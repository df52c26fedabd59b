"""Checks at length: prompts past two allocation blocks and any sliding window.

The other checks feed a few dozen tokens, which never regrow a buffer, so a
family whose K/V growth loses a row once a full 256-row block is regrown
passes them all. These feed ``long_context`` tokens (600 by default: past two
of the core's 256-row :class:`~turbospark.state.kv.LayerKV` blocks, and past any
tiny synthetic window) in uneven chunks whose edges straddle the block
boundaries, then rewind, snapshot, park and resume across them. Every row of
every chunk is compared with one chunk from a fresh state on a separately
loaded model; a failure names the first position that differs, the chunk it
was in, and which component entry differs from a fresh run, first index
included.

The dims stay tiny (the synthetic install's) and the prompts long; on the
built-in families these add 3-5 s of CPU to a kit run (13-19 s in all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, final

import numpy as np
import pytest

from turbospark.conformance.diagnose import component_differences, fail, no_component_differs
from turbospark.conformance.kit import FamilyKit
from turbospark.conformance.state_checks import return_others_to
from turbospark.conformance.turns import Step, run_script
from turbospark.state.components import State

PROMPT_SEED = 80  # one prompt for every check here, so its reference is computed once


def schedule(edges: Sequence[int], end: int, start: int = 0) -> list[int]:
    """Chunk sizes from *start* that end exactly at each of the increasing
    *edges*, then at *end*."""
    sizes, at = [], start
    for edge in [*edges, end]:
        sizes.append(edge - at)
        at = edge
    return sizes


class LongContextChecks:
    """Chunked, decoded, rewound, restored and resumed at length equals one chunk."""

    allocation_block: ClassVar[int] = 256
    """Rows a state buffer grows by (the core's ``LayerKV.step``); set it to your
    own component's block when it grows differently."""

    long_context: ClassVar[int] = 600
    """Prompt length of these checks: must pass two ``allocation_block`` s and
    any sliding window of the synthetic install."""

    def long_plan(self, kit: FamilyKit) -> tuple[int, list[int]]:
        """The prompt length and the block boundaries it crosses."""
        block, length = self.allocation_block, self.long_context
        if length <= 2 * block + 8:
            raise pytest.UsageError(
                f"long_context ({length}) must pass two allocation blocks ({2 * block}) by more "
                "than 8 tokens"
            )
        if length + 64 > kit.context_length:
            pytest.skip(f"long_context {length} does not fit context {kit.context_length}")
        return length, [block, 2 * block]

    def _diverged(
        self,
        kit: FamilyKit,
        label: str,
        state: State,
        rows: np.ndarray,
        expected: np.ndarray,
        history: Sequence[int],
        start: int,
        sizes: Sequence[int],
    ) -> None:
        """Fail unless *rows* (positions ``start..``, fed in chunks of *sizes*)
        equal *expected*, naming the first position that differs, its chunk, and
        which entries of *state* (which holds *history*) differ from a fresh run."""
        __tracebackhide__ = True
        bad = ~np.isclose(rows, expected, atol=kit.atol, rtol=kit.rtol).all(axis=-1)
        if not bad.any():
            return
        first = start + int(np.argmax(bad))
        gap = float(np.max(np.abs(rows - expected)))
        edges = np.cumsum([start, *sizes])
        chunk = int(np.searchsorted(edges, first, side="right")) - 1
        found = component_differences(kit, state, kit.fresh_state(history))
        fail(
            f"{label}: logits first differ from one fresh chunk at position {first} (in the "
            f"chunk {edges[chunk]}..{edges[chunk + 1] - 1}), by up to {gap:.3g} over all "
            f"{len(rows)} rows (the state grows in {self.allocation_block}-row blocks); at "
            f"{len(history)}: " + ("; ".join(found) or no_component_differs(kit, kit.model))
        )

    def _feed(
        self, kit: FamilyKit, state: State, tokens: Sequence[int], start: int, sizes: list[int]
    ) -> np.ndarray:
        """Feed *tokens* from *start* in chunks of *sizes*; every row's logits."""
        rows, at = [], 0
        for size in sizes:
            out = kit.forward(state, tokens[at : at + size], start + at, "all")
            assert out is not None
            rows.append(np.asarray(out, dtype=np.float32))
            at += size
        return np.concatenate(rows)

    @final
    def test_long_prompt_chunked_equals_one_chunk(self, kit: FamilyKit) -> None:
        """A long prompt fed in uneven chunks that end just before, exactly on and
        just after each block boundary, and one decoded a token at a time across
        each boundary, gives every position the logits of one fresh chunk."""
        length, boundaries = self.long_plan(kit)
        prompt = kit.tokens(PROMPT_SEED, length)
        expected = np.asarray(kit.fresh_logits(prompt, "all"), dtype=np.float32)
        first, second = boundaries
        paths = {
            "uneven chunks": schedule(
                [first - 6, first, first + 1, first + 51, second - 6, second + 7], length
            ),
            "decoding a token at a time across each block boundary": schedule(
                [
                    *(first - 3 + i for i in range(7)),
                    *(second - 3 + i for i in range(7)),
                ],
                length,
            ),
        }
        for label, sizes in paths.items():
            state = kit.new_state()
            rows = self._feed(kit, state, prompt, 0, sizes)
            text = f"{length}-token prompt, {label} ({', '.join(map(str, sizes))})"
            self._diverged(kit, text, state, rows, expected, prompt, 0, sizes)

    @final
    def test_long_rewind_across_a_block_boundary(self, kit: FamilyKit, component: str) -> None:
        """Rewinding a component from the end of a long prompt to before the
        second block boundary (or as far as its window allows), then feeding
        other tokens across it in uneven chunks, equals one fresh chunk of the
        new history at every position."""
        spec = kit.component(component)
        if spec.rewindable is False:
            pytest.skip(f"not rewindable: {component}")
        length, (first, second) = self.long_plan(kit)
        prompt = kit.tokens(PROMPT_SEED, length)
        cut = second - 7
        state = kit.new_state()
        self._feed(kit, state, prompt, 0, schedule([first, first + 1], cut))
        held = {n: c.snapshot() for n, c in state.items() if kit.component(n).persistable}
        self._feed(kit, state, prompt[cut:], cut, schedule([second - 6], length, cut))
        comp = state[component]
        back = min(comp.max_safe_rewind, length - cut)
        if back < 1:
            fail(
                f"'{component}' is declared rewindable={spec.rewindable!r} but can rewind "
                f"nothing after {length} tokens (max_safe_rewind {comp.max_safe_rewind})"
            )
        target = length - back
        comp.rewind(back)
        # The others come back from their snapshots at the cut, or (a window that
        # cannot rewind that far stops short of it) by rewinding.
        return_others_to(kit, state, component, held if target == cut else {}, back)
        tail = kit.tokens(PROMPT_SEED + 1, 40)
        history = prompt[:target] + tail
        expected = np.asarray(kit.fresh_logits(history, "all"), dtype=np.float32)[target:]
        rows = self._feed(kit, state, tail, target, [13, 27])
        label = (
            f"'{component}' rewound by {back} from {length} to {target}, then 13 and 27 other "
            "tokens"
        )
        self._diverged(kit, label, state, rows, expected, history, target, [13, 27])

    @final
    def test_long_snapshot_across_a_block_boundary(self, kit: FamilyKit, component: str) -> None:
        """A snapshot taken just past the first block boundary is not changed by
        writing on past the second; restored (in place, and into a fresh state
        when every component is persistable) and fed the same tokens in other
        chunks, it gives one fresh chunk's logits at every position."""
        if not kit.component(component).persistable:
            pytest.skip(f"not persistable: {component}")
        length, (first, second) = self.long_plan(kit)
        prompt = kit.tokens(PROMPT_SEED, length)
        expected = np.asarray(kit.fresh_logits(prompt, "all"), dtype=np.float32)
        keep = first + 4
        state = kit.new_state()
        self._feed(kit, state, prompt, 0, schedule([first - 6], keep))
        held = {n: c.snapshot() for n, c in state.items() if kit.component(n).persistable}
        copies = {key: np.array(value) for key, value in held[component].items()}
        self._feed(
            kit, state, prompt[keep:], keep, schedule([second - 6, second + 7], length, keep)
        )
        for key, value in held[component].items():
            if not np.array_equal(np.array(value), copies[key]):
                fail(
                    f"snapshot of '{component}' at {keep} changed when {length - keep} more "
                    f"tokens were written ('{key}'): it aliases a buffer the forward writes in place"
                )
        sizes = schedule([keep + 1, second, second + 1], length, keep)
        text = f"restored from snapshots at {keep}, then fed to {length} in chunks of " + ", ".join(
            map(str, sizes)
        )
        state[component].restore(held[component])
        return_others_to(kit, state, component, held, length - keep)
        rows = self._feed(kit, state, prompt[keep:], keep, sizes)
        self._diverged(
            kit, f"'{component}' {text}", state, rows, expected[keep:], prompt, keep, sizes
        )
        if len(held) == len(state):
            fresh = kit.new_state()
            for name, each in fresh.items():
                each.restore(held[name])
            rows = self._feed(kit, fresh, prompt[keep:], keep, sizes)
            self._diverged(
                kit, f"a fresh state {text}", fresh, rows, expected[keep:], prompt, keep, sizes
            )

    @final
    def test_long_session_parks_and_resumes(self, kit: FamilyKit) -> None:
        """A conversation grown past the first block boundary, parked while
        another runs, swaps back in whole and grows past the second; every turn
        and decode equals a fresh run of its own history."""
        kit.require_pool()
        _, (first, second) = self.long_plan(kit)
        runner = kit.open(2)
        histories: dict[str, list[int]] = {}
        opening = Step("A", tuple(kit.tokens(PROMPT_SEED, first + 9)))
        run_script(
            kit, runner, [opening, Step("B", tuple(kit.tokens(PROMPT_SEED + 2, 40)))], histories
        )
        before = len(histories["A"])
        step = Step("A", tuple(kit.tokens(PROMPT_SEED + 3, second - first)))
        (turn,) = run_script(kit, runner, [step], histories)
        if not turn.swapped or turn.kept != before:
            fail(
                f"{turn.describe()}: the parked {before}-token conversation A should have "
                "been swapped in and kept whole"
            )
