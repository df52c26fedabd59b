"""The server's path end to end, under random interleavings: every conversation
served through one pooled runner (swaps, shared openings, a parked-memory cap
that evicts, stop ids taken back) decodes exactly what a fresh runner would."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbospark import Runner
from turbospark.generate import GenerationConfig, generate
from turbospark.text import TextCodec, load_text

OPENING = [1, 3, 20, 21]  # what every conversation's template starts with
CONFIG = GenerationConfig(max_tokens=3, stop_token_ids=[2, 40, 77])


def fresh(path: Path, codec: TextCodec, prompt: list[int]) -> list[int]:
    return generate(Runner.open(path), codec, prompt, CONFIG).tokens


schedules = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(30, 120), min_size=1, max_size=6)),
    min_size=2,
    max_size=8,
)


@pytest.mark.slow  # a hypothesis fuzz of whole generations: the suite's longest check
@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(schedule=schedules, cap_sessions=st.sampled_from([None, 1]))
def test_pooled_generation_equals_fresh_generation(family, request, schedule, cap_sessions):
    path = request.getfixturevalue(f"{family}_install")
    codec = load_text(path)
    probe = Runner.open(path)
    probe.prefill_chunk(OPENING + [50] * 12, 0)
    cap = None if cap_sessions is None else cap_sessions * probe.session_nbytes()[0]
    runner = Runner.open(path, session_slots=3, max_parked_bytes=cap)
    runner.set_prefix_reuse(True)
    histories: dict[int, list[int]] = {}
    for conversation, new in schedule:
        prompt = histories.get(conversation, list(OPENING)) + new
        done = generate(runner, codec, prompt, CONFIG)
        assert done.tokens == fresh(path, codec, prompt), (conversation, done.stats.reuse_reason)
        histories[conversation] = prompt + done.tokens
