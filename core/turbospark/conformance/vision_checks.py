"""Vision taint, both ways: image placeholder ids prove nothing about content.

An image prompt must not select a parked session (its ids may match one built
from another picture), and state built while a map was active stays tainted
after it is parked. Families need not use images; the rules are about the
session, so every family that supports a pool must keep them.
"""

from __future__ import annotations

from typing import final

import mlx.core as mx
import numpy as np

from turbospark.conformance.diagnose import fail
from turbospark.conformance.kit import FamilyKit
from turbospark.conformance.turns import Step, check_turn, run_script, take_turn
from turbospark.contract.vision import MropePositions, VisionInjection
from turbospark.generation.runner import Runner

IMAGE_AT, IMAGE_ROWS = 4, 3  # where the injected "image" sits in a vision prompt


def install_vision(kit: FamilyKit, runner: Runner, prompt_len: int, seed: int) -> None:
    """A map with one injected image and plain (i, i, i) rope triples."""
    rows = np.random.default_rng(seed).normal(0.0, 1.0, (IMAGE_ROWS, kit.arch.hidden_size))
    runner.set_prompt_vision(
        [VisionInjection(IMAGE_AT, mx.array(rows, dtype=mx.float32))],
        MropePositions(triples=[(i, i, i) for i in range(prompt_len)]),
        prompt_len,
    )


class VisionChecks:
    """The two directions of vision taint over a pool."""

    @final
    def test_image_prompt_cannot_select_a_parked_session(self, kit: FamilyKit) -> None:
        """With a vision map active, a prompt whose ids extend a parked
        conversation is not served from it; once the map is cleared it is."""
        kit.require_pool()
        runner = kit.open(3)
        histories: dict[str, list[int]] = {}
        run_script(kit, runner, [Step("A", (0, *kit.tokens(80, 11)))], histories)
        run_script(kit, runner, [Step("B", (1, *kit.tokens(81, 9)))], histories)
        prompt = [*histories["A"], *kit.tokens(82, 4)]
        install_vision(kit, runner, len(prompt), 83)
        kept = runner.try_reuse_prefix(prompt)
        if kept or runner.last_reuse.swapped:
            fail(
                f"with a vision map active, a prompt extending parked conversation A kept {kept} "
                f"(swapped={runner.last_reuse.swapped}): placeholder ids cannot prove a match"
            )
        # The same prompt with the same map through a runner without a pool.
        alone = kit.open(1)
        install_vision(kit, alone, len(prompt), 83)
        expected = alone.prefill_chunk(prompt, 0)
        runner.reset()
        assert expected is not None
        gap = kit.logits_gap(runner.prefill_chunk(prompt, 0), expected)
        if gap is not None:
            fail(
                "a vision prompt served beside a pool differs from one served alone by up to "
                f"{gap:.3g}"
            )
        runner.clear_prompt_vision()
        turn = take_turn(runner, "A", prompt)
        if not turn.swapped or turn.kept != len(histories["A"]):
            fail(
                f"after clear_prompt_vision(), {turn.describe()} should resume parked "
                f"conversation A whole ({len(histories['A'])} tokens)"
            )
        check_turn(kit, runner, turn, prompt)

    @final
    def test_state_built_under_a_map_stays_tainted(self, kit: FamilyKit) -> None:
        """A conversation fed while a map was active cannot be reused by ids,
        neither live after the map is cleared nor after it is parked."""
        kit.require_pool()
        runner = kit.open(2)
        prompt = [0, *kit.tokens(85, 12)]
        install_vision(kit, runner, len(prompt), 86)
        runner.reset()
        runner.prefill_chunk(prompt, 0)
        runner.clear_prompt_vision()
        follow_up = [*prompt, *kit.tokens(87, 3)]
        kept = runner.try_reuse_prefix(follow_up)
        if kept:
            fail(
                f"the live session built under a vision map kept {kept} tokens after the map "
                "was cleared"
            )
        runner.reset()  # parks the tainted conversation
        kept = runner.try_reuse_prefix(follow_up)
        if kept or runner.last_reuse.swapped:
            fail(
                f"a parked session built under a vision map was reused for a text prompt with "
                f"the same ids (kept {kept}, swapped={runner.last_reuse.swapped})"
            )
        turn = take_turn(runner, "the text conversation", follow_up)
        check_turn(kit, runner, turn, follow_up)
