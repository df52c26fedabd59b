"""Routed experts: every ``ExpertCacheSlots`` gives the same logits.

For a family that declares MoE experts (``turbospark_moe`` returns a spec for
the kit's install), the install is opened with ``all()``, ``fixed(top_k)``
and ``fixed(2 * top_k)``; a prompt fed in one chunk (logits of every row) and
then decoded token by token must give *equal* logits under each: streaming
reads the same numbers into slots, so nothing may differ, not even in the last
bit. ``fixed(top_k)`` also makes every prefill step route to more experts than
there are slots, so the grouped path runs. A family without MoE skips, naming why.
"""

from __future__ import annotations

from typing import final

import mlx.core as mx
import pytest

from turbospark.conformance.diagnose import fail
from turbospark.conformance.kit import FamilyKit
from turbospark.generation.runner import Runner
from turbospark.policies import ExpertCacheSlots


class ExpertCacheChecks:
    """Streaming experts through a bounded cache changes no logit."""

    @final
    def test_expert_cache_slots_give_identical_logits(self, kit: FamilyKit) -> None:
        """A 24-token prompt in one chunk, then 6 decode steps: logits under
        ``fixed(top_k)`` and ``fixed(2*top_k)`` equal those under ``all()``."""
        moe = kit.hook.turbospark_moe(arch=kit.arch)
        if moe is None:
            pytest.skip("no MoE experts: turbospark_moe declares none for this install")
        prompt, steps = kit.tokens(500, 24), kit.tokens(501, 6)
        reference = _run(kit, ExpertCacheSlots.all(), prompt, steps)
        for slots in sorted({moe.top_k, 2 * moe.top_k}):
            if slots >= moe.num_experts:
                continue  # that many slots hold every expert: nothing streams
            got = _run(kit, ExpertCacheSlots.fixed(slots), prompt, steps)
            for step, (a, b) in enumerate(zip(got, reference, strict=True)):
                if not mx.array_equal(a, b):
                    what = "the prompt's logits" if step == 0 else f"decode step {step}"
                    gap = float(mx.abs(a - b).max())
                    fail(
                        f"ExpertCacheSlots.fixed({slots}): {what} differ from all() by {gap:.3g}; "
                        "streamed experts must be read exactly as the resident ones "
                        "(check turbospark_moe's tensors and rows against sanitize)"
                    )


def _run(
    kit: FamilyKit, policy: ExpertCacheSlots, prompt: list[int], steps: list[int]
) -> list[mx.array]:
    """Logits of every prompt row, then of each decode step, under *policy*."""
    runner = Runner.open(
        kit.source,
        context_length=kit.context_length,
        expert_cache=policy,
        registry=kit.registry,
        dtype=mx.float32,
    )
    state = kit.hook.turbospark_new_state(
        arch=kit.arch, model=runner.model, context_length=kit.context_length
    )
    outs = []
    position = 0
    for tokens, wanted in [(prompt, "all"), *(([t], "last") for t in steps)]:
        out = kit.hook.turbospark_forward(
            model=runner.model,
            tokens=mx.array(tokens, dtype=mx.int32),
            start=position,
            state=state,
            vision=None,
            logits=wanted,
            steer=None,
        )
        mx.eval(out)
        outs.append(out)
        position += len(tokens)
    return outs
