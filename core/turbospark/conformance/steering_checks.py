"""Checks on activation steering, for a family whose spec says ``steerable``.

The family's part is small (call ``steer(i, h)`` at every layer's output, or
hand the layer's last residual join to :func:`turbospark.policies.steering.joiner`), but
a hook in the wrong place, a layer skipped, or a batched row steered with
another row's vector changes every token after it silently. So: scale 0 equals
off, a vector on one layer leaves every layer below it bit-identical, chunked
prefill equals sequential feeding under steering, the joined form equals the
plain hook, batched rows equal themselves alone, and the pool never reuses state across steering settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import mlx.core as mx
import numpy as np
import pytest

from turbospark.conformance.diagnose import fail
from turbospark.conformance.kit import FamilyKit
from turbospark.contract.protocols import LayerHook
from turbospark.policies.steering import Steer, SteeringPolicy
from turbospark.sessions.reuse import ReuseReason
from turbospark.state.components import State


def policy(
    kit: FamilyKit, layers: Sequence[int], scale: float = 4.0, mode: str = "add"
) -> SteeringPolicy:
    """A random control vector on *layers* (llama.cpp numbering), as big as the
    hidden states are, so its effect is far above the comparison tolerance."""
    rng = np.random.default_rng(7)
    width = kit.arch.hidden_size
    return SteeringPolicy.from_directions(
        {k: rng.standard_normal(width).astype(np.float32) for k in layers}, scale, mode
    )


class _Recorder:
    """Passes each layer's output through *steer* and keeps what came out."""

    def __init__(self, steer: LayerHook | None) -> None:
        self.steer = steer
        self.seen: list[tuple[int, np.ndarray]] = []

    def __call__(self, layer: int, h: mx.array) -> mx.array:
        out = h if self.steer is None else self.steer(layer, h)
        self.seen.append((layer, np.array(out)))
        return out


class SteeringChecks:
    """Steering at each layer's output: neutral, local, chunk- and batch-invariant."""

    def require_steering(self, kit: FamilyKit) -> None:
        if not kit.spec.steerable:
            pytest.skip("not steerable: the family's FamilySpec does not declare steerable")

    @final
    def test_steering_scale_zero_equals_off(self, kit: FamilyKit) -> None:
        """A vector on every layer at scale 0 gives logits identical to no steering."""
        self.require_steering(kit)
        every = range(1, kit.arch.num_hidden_layers)
        prompt = kit.tokens(120, 9)
        plain = kit.open(1).prefill_chunk(prompt, 0)
        zero = kit.open(1, steering=policy(kit, every, scale=0.0)).prefill_chunk(prompt, 0)
        if not np.array_equal(np.array(plain), np.array(zero)):
            fail("steering at scale 0 changed the logits; with s = 0 it must be exact identity")

    @final
    def test_one_layer_leaves_the_layers_below_identical(self, kit: FamilyKit) -> None:
        """A vector on the last layer only: every lower layer's output is
        bit-identical to an unsteered run (over two chunks, so state written
        under steering is read back), and the logits change."""
        self.require_steering(kit)
        top = kit.arch.num_hidden_layers - 1
        if top < 1:
            pytest.skip("one layer: llama.cpp never steers layer 0")
        steer = Steer.of([policy(kit, [top])], mx.float32)
        prompt = kit.tokens(121, 10)
        runs = {}
        # The unsteered reference runs on a model of its own.
        for name, hook, model in (("off", None, kit.load_model()), ("steered", steer, kit.model)):
            state, recorder = kit.new_state(model), _Recorder(hook)
            kit.forward(state, prompt[:6], 0, "none", model=model, steer=recorder)
            logits = kit.forward(state, prompt[6:], 6, "last", model=model, steer=recorder)
            runs[name] = (recorder.seen, np.array(logits))
        (off, off_logits), (steered, steered_logits) = runs["off"], runs["steered"]
        every = list(range(kit.arch.num_hidden_layers)) * 2  # two forwards
        for name, seen in (("without", off), ("with", steered)):
            if [layer for layer, _ in seen] != every:
                fail(
                    f"{name} a vector, two forwards called steer(i, h) for layers "
                    f"{[layer for layer, _ in seen]}; expected every layer 0..{top} once per "
                    "forward, in order, each with that layer's own output"
                )
        for index, ((layer, a), (_, b)) in enumerate(zip(off, steered, strict=True)):
            if layer < top and not np.array_equal(a, b):
                fail(
                    f"layer {layer}'s output changed (call {index}) under a vector on layer "
                    f"{top} only: the hook runs before that layer's output, or state leaks"
                )
        if kit.logits_gap(steered_logits, off_logits) is None:
            fail(f"a vector on layer {top} did not change the logits: the hook is not applied")

    @final
    def test_steered_chunked_prefill_equals_sequential(self, kit: FamilyKit) -> None:
        """Under steering, one chunk and token-by-token feeding agree."""
        self.require_steering(kit)
        steering = policy(kit, range(1, kit.arch.num_hidden_layers), scale=1.0)
        prompt = kit.tokens(122, 8)
        chunked = kit.open(1, steering=steering).prefill_chunk(prompt, 0)
        runner = kit.open(1, steering=steering)
        for position, token in enumerate(prompt[:-1]):
            runner.produce_prefill(token, position)
        sequential = runner.produce(prompt[-1], len(prompt) - 1)
        gap = kit.logits_gap(sequential, chunked)
        if gap is not None:
            fail(f"steered chunked prefill and sequential feeding differ by {gap:.3g}")

    @final
    def test_joined_steering_equals_the_plain_hook(self, kit: FamilyKit) -> None:
        """A family may hand its last residual join to the steering
        (:func:`turbospark.policies.steering.joiner`; in a compiled step, folded into
        its compiled tail), so ``add`` costs no extra kernel: for each mode, a
        chunk and one-token steps after it give the logits that a plain
        ``steer(i, h)`` hook on each layer's output gives."""
        self.require_steering(kit)
        layers = range(1, kit.arch.num_hidden_layers)
        prompt = kit.tokens(123, 12)
        for mode in ("add", "renorm", "clamp"):
            steer = Steer.of([policy(kit, layers, 0.7, mode)], mx.float32)
            runs = []
            plain = (
                lambda layer, h, steer=steer: steer(layer, h),
                kit.load_model(),
            )  # the reference
            for hook, model in ((steer, kit.model), plain):
                state = kit.new_state(model)
                out = [kit.forward(state, prompt[:10], 0, "last", model=model, steer=hook)]
                for position in (10, 11):
                    out.append(kit.forward(state, prompt[position : position + 1], position,
                                           "last", model=model, steer=hook))  # fmt: skip
                runs.append(out)
            for step, (joined, plain) in enumerate(zip(*runs, strict=True)):
                gap = kit.logits_gap(joined, plain)
                if gap is not None:
                    fail(f"{mode}: the joined steering differs from steer(i, h) by {gap:.3g} "
                         f"at forward {step}: the join must be the layer's own last residual op")  # fmt: skip

    @final
    def test_batched_steered_rows_equal_each_row_alone(self, kit: FamilyKit) -> None:
        """Rows under add, none and clamp (different vectors) in one batched
        step: each row's logits equal its session stepped alone."""
        self.require_steering(kit)
        if not kit.open(1).batchable:
            pytest.skip("not batchable: the engine decodes steered rows one at a time")
        layers = range(1, kit.arch.num_hidden_layers)
        rows = [policy(kit, layers, 2.0), None, policy(kit, layers, 0.5, "clamp")]
        histories = [kit.tokens(130 + i, n) for i, n in enumerate((5, 9, 3))]
        states, nexts = [], kit.tokens(140, len(rows))
        alone = []
        for setting, history, token in zip(rows, histories, nexts, strict=True):
            steer = Steer.of([setting], mx.float32)
            for keep, model in (
                (states, kit.model),
                (None, kit.load_model()),
            ):  # alone: its own model
                state = kit.new_state(model)
                kit.forward(state, history, 0, "none", model=model, steer=steer)
                if keep is not None:
                    keep.append(state)
                else:
                    alone.append(
                        kit.forward(state, [token], len(history), model=model, steer=steer)
                    )
        batch: State = {
            name: type(component).merge([s[name] for s in states])
            for name, component in states[0].items()
        }
        for component in batch.values():
            component.prepare(1)
        out = kit.hook.turbospark_forward_batch(
            model=kit.model,
            tokens=mx.array(nexts, dtype=mx.int32)[:, None],
            positions=[len(h) for h in histories],
            state=batch,
            logits="last",
            steer=Steer.of(rows, mx.float32),
        )
        for i, expected in enumerate(alone):
            gap = kit.logits_gap(out[i], expected)
            if gap is not None:
                fail(f"batched row {i} ({rows[i] and rows[i].mode}) differs alone by {gap:.3g}")

    @final
    def test_pool_never_reuses_across_steering(self, kit: FamilyKit) -> None:
        """A conversation built unsteered is refused to a steered request of the same
        prompt (``steering_changed``) and shares no opening with it; the steered
        turn equals a fresh steered run; the unsteered conversation still serves
        its own continuation afterwards."""
        self.require_steering(kit)
        kit.require_pool()
        steering = policy(kit, range(1, kit.arch.num_hidden_layers), 1.0)
        runner = kit.open(2)
        prompt = kit.tokens(150, 8)
        runner.use_steering(None)
        runner.prefill_chunk(prompt, 0)
        runner.use_steering(steering)
        longer = [*prompt, *kit.tokens(151, 3)]
        if runner.try_reuse_prefix(longer) != 0:
            fail("state built without steering was reused for a steered request")
        report = runner.last_reuse
        if report.reason != ReuseReason.STEERING_CHANGED or "steering" not in report.detail:
            fail(f"reuse across steering reported {report.reason}: {report.detail}")
        runner.reset()
        if runner.share_prefix(longer) != 0:
            fail("a steered request took its opening from an unsteered conversation")
        got = runner.prefill_chunk(longer, 0)
        fresh = kit.open(1, steering=steering).prefill_chunk(longer, 0)
        gap = kit.logits_gap(got, fresh)
        if gap is not None:
            fail(f"the steered turn differs from a fresh steered run by {gap:.3g}")
        runner.use_steering(None)
        if runner.try_reuse_prefix(longer) != len(prompt):
            fail(
                "the unsteered conversation was not resumed for its own continuation: "
                f"{runner.last_reuse.reason} ({runner.last_reuse.detail})"
            )
