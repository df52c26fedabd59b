"""The server's path end to end, under random interleavings: every conversation
served through one pooled runner (swaps, shared openings, a parked-memory cap
that evicts, stop ids taken back) decodes exactly what a fresh runner would."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import text_positions
from turbospark import Runner
from turbospark.generation.generate import GenerationConfig, generate
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


def _vision_generate(runner: Runner, codec: TextCodec, prompt: list[int]) -> list[int]:
    """An image turn: placeholder ids under a vision map (taints the session)."""
    runner.set_prompt_vision([], text_positions(len(prompt)), len(prompt))
    try:
        return generate(runner, codec, prompt, CONFIG).tokens
    finally:
        runner.clear_prompt_vision()


steps = st.lists(
    st.one_of(
        st.tuples(st.just("turn"), st.integers(0, 3), st.lists(st.integers(30, 120), min_size=1, max_size=5)),
        st.tuples(st.sampled_from(["restart", "crash", "snapshot", "vision"]), st.just(0), st.just([])),
    ),
    min_size=3,
    max_size=9,
)  # fmt: skip


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(schedule=steps, slots=st.sampled_from([2, 3]), bounded=st.booleans())
def test_disk_sessions_are_found_again_and_equal_fresh(
    family, request, tmp_path_factory, schedule, slots, bounded
):
    """The server's path with a disk tier (write-through after each request) under
    restarts, crashes, snapshot/restore round trips and image turns: every reply
    equals a fresh runner's, and a conversation is always found again (at least
    its previous prompt reused) unless an eviction was reported. With an
    unbounded directory, memory only ever loses image sessions (tainted ids
    cannot be found, so they are never written)."""
    path = request.getfixturevalue(f"{family}_install")
    codec = load_text(path)
    directory = tmp_path_factory.mktemp("sessions")
    bound = None
    if bounded:  # room for about three short conversations
        probe = Runner.open(path, session_slots=2, session_dir=tmp_path_factory.mktemp("probe"))
        probe.prefill_chunk(OPENING + [50] * 12, 0)
        probe.flush()
        bound = 3 * probe.session_disk.nbytes

    def open_runner() -> Runner:
        runner = Runner.open(
            path, session_slots=slots, session_dir=directory, max_session_disk_bytes=bound
        )
        runner.set_prefix_reuse(True)
        return runner

    runner = open_runner()
    histories: dict[int, list[int]] = {}
    previous: dict[int, int] = {}  # the length of each conversation's last prompt
    must_find: set[int] = set()
    images = 0
    for op, conversation, new in schedule:
        evictions = runner.session_disk.evictions
        if op == "restart":
            runner.close()
            runner = open_runner()
        elif op == "crash":  # no close(): only what write-through wrote survives
            runner = open_runner()
            if bounded:  # the bound may have deleted the file of a session in memory
                must_find.clear()
        elif op == "snapshot":
            snapshot = runner.snapshot()
            runner.reset()  # parks (or spills) the original; the copy must equal it
            lost = runner.session_slot_evicted()
            runner.restore(snapshot)
            runner.flush()
            assert not lost or images or bounded
            if lost:
                must_find.clear()
        elif op == "vision":
            images += 1
            prompt = [*OPENING, 5, images, *range(60, 66)]
            assert _vision_generate(runner, codec, prompt) == _vision_generate(
                Runner.open(path), codec, prompt
            )
            runner.flush()
        else:
            # Conversations share only the template's OPENING, and never less than
            # twice as much of their own: another one can only ever take that opening.
            opening = [*OPENING, 100 + conversation, *[50 + conversation] * 5]
            prompt = histories.get(conversation, opening) + new
            done = generate(runner, codec, prompt, CONFIG)
            runner.flush()  # what the server does after each request
            stats = done.stats
            assert done.tokens == fresh(path, codec, prompt), (conversation, stats.reuse_reason)
            if conversation in must_find:
                assert stats.reused_tokens >= previous[conversation], stats
            assert not stats.evicted or images or bounded, stats
            if stats.evicted:
                must_find.clear()
            histories[conversation] = prompt + done.tokens
            previous[conversation] = len(prompt)
            must_find.add(conversation)
        if runner.session_disk.evictions > evictions:
            must_find.clear()
    assert not runner.session_disk.rejected
    runner.close()
