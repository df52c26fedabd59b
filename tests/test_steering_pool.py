"""Schedules of conversations under different steering through one pool: every
turn's logits equal a fresh run of its prompt under its own setting, so no
reuse, swap or shared opening ever crosses steering settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbospark import Runner
from turbospark.policies.steering import SteeringPolicy
from turbospark.sessions.reuse import ReuseReason

SETTINGS = ("off", "add", "clamp")


def policies(width: int) -> dict[str, SteeringPolicy]:
    rng = np.random.default_rng(3)
    vector = {1: 4 * rng.standard_normal(width).astype(np.float32)}
    return {
        "off": SteeringPolicy.off(),
        "add": SteeringPolicy.from_directions(vector, 1.0, "add"),
        "clamp": SteeringPolicy.from_directions(vector, 2.0, "clamp"),
    }


turn = st.tuples(
    st.integers(0, 2),  # which conversation
    st.sampled_from(SETTINGS),  # under which steering
    st.lists(st.integers(6, 127), min_size=1, max_size=4),  # its new tokens
)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(schedule=st.lists(turn, min_size=2, max_size=6))
def test_reuse_never_crosses_steering(gemma4_install: Path, schedule) -> None:
    runner = Runner.open(gemma4_install, session_slots=3, dtype="float32")
    runner.set_prefix_reuse(True)
    steering = policies(runner.arch.hidden_size)
    fresh = {
        name: Runner.open(gemma4_install, dtype="float32", steering=p)
        for name, p in steering.items()
    }
    history: dict[int, list[int]] = {0: [2, 3], 1: [2, 3], 2: [2, 4]}  # a shared opening
    for conversation, name, tokens in schedule:
        prompt = history[conversation] + tokens
        runner.use_steering(steering[name])
        kept = runner.try_reuse_prefix(prompt)
        report = runner.last_reuse
        if kept == 0:
            runner.reset()
            kept = runner.share_prefix(prompt)
        got = np.array(runner.prefill_chunk(prompt[kept:], kept))
        reference = fresh[name]
        reference.reset()
        expected = np.array(reference.prefill_chunk(prompt, 0))
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
        if report.reason == ReuseReason.STEERING_CHANGED:
            assert report.kept == 0 and f"asks for {steering[name].describe()}" in report.detail
        history[conversation] = prompt
