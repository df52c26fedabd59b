"""Speculative decoding: drafts never change greedy output, and rollback leaves no trace.

The checks, for every family whose components can all drop a rejected draft
(rewind, or trace the verify pass; a family that cannot is skipped naming the
components, and the runner refuses draft policies for it the same way):

- **greedy output equals off**: drafters right 100%, 50% and 0% of the time
  (replaying the reply decoded without drafts) and prompt lookup give, at
  temperature 0, exactly the tokens decoding without drafts gives, and leave
  the session holding exactly what decoding without drafts leaves;
- **rollback leaves no trace**: a verify pass's logits equal fresh runs of
  each prefix, and after keeping any prefix of it the next step's logits
  equal a fresh run of the kept history; and the same with the forms a GPU
  builds (``turbospark.layers.fused.BUILD_FOR_GPU`` forced on: a short
  verify pass takes fewer-kernel forms there, e.g. the gated DeltaNet stepped
  token by token and few-query attention by matmuls);
- **MTP drafts change nothing** (a family with an MTP head, on an install that
  carries one: the class's ``synthetic_dims`` asks the family's synthetic
  build for it): ``turbospark_forward_with_hidden``'s logits are
  ``turbospark_forward``'s, and ``DraftPolicies.mtp`` at temperature 0 gives
  exactly the tokens, and leaves exactly the session, decoding without drafts does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import mlx.core as mx
import pytest

from turbospark.conformance.diagnose import component_differences, fail, no_component_differs
from turbospark.conformance.kit import FamilyKit
from turbospark.generation.drafters import Drafter, NgramDrafter, ReplayDrafter
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.opening import has_mtp_hooks
from turbospark.generation.runner import Runner
from turbospark.layers import fused
from turbospark.policies import DraftPolicies
from turbospark.text import load_text

GREEDY = GenerationConfig(max_tokens=16, stop_token_ids=[])


def require_rollback(kit: FamilyKit) -> None:
    """Skip, naming them, when some component can neither rewind nor trace."""
    stuck = [c.name for c in kit.spec.components if c.rewindable is False and not c.traceable]
    if stuck:
        pytest.skip(f"cannot roll back a draft: {', '.join(stuck)} neither rewind nor trace")


class DraftChecks:
    """Speculative decoding is invisible at temperature 0."""

    @final
    def test_drafted_greedy_output_equals_off(self, kit: FamilyKit) -> None:
        require_rollback(kit)
        codec = load_text(kit.install)
        opening = kit.tokens(70, 14)
        prompt = [*opening, *kit.tokens(71, 6), *opening[:6]]  # a repeat for prompt lookup
        off = generate(kit.open(1), codec, prompt, GREEDY).tokens
        reference = [*prompt, *off]
        drafters: dict[str, Drafter] = {
            "a 100% right": ReplayDrafter(reference, kit.arch.vocab_size, 4, 1.0),
            "a 50% right": ReplayDrafter(reference, kit.arch.vocab_size, 4, 0.5, seed=1),
            "a 0% right": ReplayDrafter(reference, kit.arch.vocab_size, 4, 0.0),
            "the prompt-lookup": NgramDrafter(4, 1),
        }
        for name, drafter in drafters.items():
            runner = kit.open(1)
            drafted = generate(runner, codec, prompt, GREEDY, drafter=drafter).tokens
            if drafted != off:
                at = next(i for i, (a, b) in enumerate(zip(drafted, off, strict=False)) if a != b)
                fail(
                    f"with {name} drafter, greedy output differs from decoding without drafts "
                    f"at token {at}: {drafted[at]} instead of {off[at]}; "
                    + explain_drafted(kit, runner)
                )
            held = runner.sessions()[0].record.tokens
            if held != reference[:-1]:
                fail(
                    f"with {name} drafter, the session holds {len(held)} tokens, not the "
                    f"{len(reference) - 1} decoding without drafts leaves: a rejected or "
                    "unemitted token stayed fed; " + explain_drafted(kit, runner)
                )

    @final
    def test_a_rejected_draft_leaves_no_trace(self, kit: FamilyKit) -> None:
        require_rollback(kit)
        rollback_leaves_no_trace(kit)

    @final
    def test_a_rejected_draft_leaves_no_trace_in_gpu_forms(self, kit: FamilyKit) -> None:
        require_rollback(kit)
        built = fused.BUILD_FOR_GPU
        fused.BUILD_FOR_GPU = True
        try:
            rollback_leaves_no_trace(kit, " (GPU forms)")
        finally:
            fused.BUILD_FOR_GPU = built

    @final
    def test_mtp_drafts_change_nothing(self, kit: FamilyKit) -> None:
        require_rollback(kit)
        if not has_mtp_hooks(kit.family.manager()):
            pytest.skip("no multi-token-prediction head (turbospark_mtp_head)")
        if kit.hook.turbospark_mtp_head(model=kit.model) is None:
            pytest.skip("the install carries no MTP head; synthetic_dims can ask for one")
        prompt = kit.tokens(75, 16)
        logits, hidden = kit.hook.turbospark_forward_with_hidden(
            model=kit.model,
            tokens=mx.array(prompt, dtype=mx.int32),
            start=0,
            state=kit.new_state(),
            vision=None,
            logits="all",
            steer=None,
        )
        gap = kit.logits_gap(logits, kit.fresh_logits(prompt, "all"))
        if gap is not None:
            fail(
                f"turbospark_forward_with_hidden's logits differ from turbospark_forward's by {gap:.3g}"
            )
        if hidden.shape[0] != len(prompt):
            fail(
                f"turbospark_forward_with_hidden gave {hidden.shape[0]} hidden rows for {len(prompt)} tokens"
            )
        codec = load_text(kit.install)
        off = generate(kit.open(1), codec, prompt, GREEDY).tokens
        for depth in (1, 3):
            runner = kit.open(1, draft=DraftPolicies.mtp(depth))
            drafted = generate(runner, codec, prompt, GREEDY)
            if drafted.tokens != off:
                fail(
                    f"with DraftPolicies.mtp({depth}), greedy output differs from decoding without "
                    "drafts; " + explain_drafted(kit, runner)
                )
            if not drafted.stats.draft_proposed:
                fail(f"DraftPolicies.mtp({depth}) proposed no draft in {len(off)} tokens")
            if runner.sessions()[0].record.tokens != [*prompt, *off[:-1]]:
                fail(
                    f"with DraftPolicies.mtp({depth}), a rejected or unemitted token stayed fed; "
                    + explain_drafted(kit, runner)
                )


def explain_drafted(kit: FamilyKit, runner: Runner, history: Sequence[int] | None = None) -> str:
    """Which component, layer (the entry's prefix) and index of the live
    session differ from a fresh run of *history* (default: what its record says
    it holds)."""
    session = runner.sessions()[0]
    history = session.record.tokens if history is None else history
    found = component_differences(kit, session.state, kit.fresh_state(history))
    return f"the session after it, against a fresh run of its {len(history)} tokens: " + (
        "; ".join(found) or no_component_differs(kit, runner.model)
    )


def rollback_leaves_no_trace(kit: FamilyKit, forms: str = "") -> None:
    """Verify a confirmed token and four drafts, check every row against a
    fresh run, keep 1, 2 or all 5, and check the next step against a fresh
    run of the kept history; *forms* names the forms in a failure."""
    prompt = kit.tokens(72, 12)
    fed = kit.tokens(73, 5)  # a confirmed token and four drafts
    after = kit.tokens(74, 1)
    for keep in (1, 2, 5):
        runner = kit.open(1)
        runner.prefill_chunk(prompt, 0)
        rows = runner.verify(None, fed, len(prompt))
        for j in range(len(fed)):
            gap = kit.logits_gap(rows[j], kit.fresh_logits([*prompt, *fed[: j + 1]]))
            if gap is not None:
                fail(
                    f"row {j} of a verify pass{forms} differs from a fresh run of the same "
                    f"tokens by {gap:.3g}; " + explain_drafted(kit, runner, [*prompt, *fed])
                )
        runner.accept(None, len(prompt), keep)
        history = [*prompt, *fed[:keep]]
        if runner.position != len(history):
            fail(
                f"keeping {keep} of {len(fed)} verified tokens{forms} left position {runner.position}"
            )
        nxt = runner.produce(after[0], len(history))
        gap = kit.logits_gap(nxt, kit.fresh_logits([*history, *after]))
        if gap is not None:
            fail(
                f"after verifying {len(fed)} tokens{forms} and keeping {keep}, the next step's "
                f"logits differ from a fresh run of the kept history by {gap:.3g}: "
                "a rejected token left a trace in the state; "
                + explain_drafted(kit, runner, [*history, *after])
            )
