"""A session's bytes count each buffer it holds once, and a parked one holds no other.

A checkpoint holds references to the state's own arrays (taken where the
state still is) or to another checkpoint's, so adding every holder's arrays
would count one buffer several times and evict warm sessions early. The
independent measure here is the buffer itself: the address MLX's data sits
at, read through the buffer protocol.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import memory_in_use, open_runner, serve_turn
from turbospark import Runner, build_synthetic_install
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.sessions.session import Checkpoint, Session
from turbospark.state.components import state_nbytes
from turbospark.text import load_text

PROMPT = [1, 3, 20, 21, 22, 23, 24, 25]
OTHER = [1, 3, 40, 41, 42, 43, 44, 45]  # as long as PROMPT: the same bytes


def buffer_bytes(session: Session) -> int:
    """Bytes of the distinct buffers the session's arrays sit in (each
    buffer once, at the largest extent any array of it covers)."""
    arrays = [a for c in session.state.values() for a in c.arrays()]
    arrays += [a for cp in session.checkpoints for snap in cp.snapshots.values() for a in snap.values()]  # fmt: skip
    mx.eval(arrays)
    extent: dict[int, int] = {}
    for a in arrays:
        address = np.asarray(memoryview(a)).__array_interface__["data"][0]
        extent[address] = max(extent.get(address, 0), a.nbytes)
    return sum(extent.values())


def summed_bytes(session: Session) -> int:
    """Every holder's arrays added up: what counting per holder gives."""
    return state_nbytes(session.state) + sum(
        a.nbytes
        for cp in session.checkpoints
        for snap in cp.snapshots.values()
        for a in snap.values()
    )


def test_a_checkpoint_sharing_the_states_arrays_counts_them_once(qwen_gdn_install: Path) -> None:
    runner = open_runner(qwen_gdn_install, 1)
    serve_turn(runner, PROMPT)  # a checkpoint at the prompt's end: the state's own arrays
    session = runner.sessions()[0]
    assert len(session.checkpoints) == 1
    assert session.nbytes == buffer_bytes(session)
    assert session.nbytes < summed_bytes(session)  # the shared recurrent state, once
    assert runner.session_nbytes() == [session.nbytes]


def test_checkpoints_sharing_each_others_arrays_count_them_once(qwen_gdn_install: Path) -> None:
    runner = open_runner(qwen_gdn_install, 1)
    serve_turn(runner, PROMPT)
    session = runner.sessions()[0]
    first = session.checkpoints[0]
    session.checkpoints.append(Checkpoint(first.position, dict(first.snapshots)))
    assert session.nbytes == buffer_bytes(session)


def test_a_checkpoint_the_state_has_moved_past_counts_both(qwen_gdn_install: Path) -> None:
    runner = open_runner(qwen_gdn_install, 1)
    serve_turn(runner, PROMPT)
    runner.prefill_chunk([7, 8], len(PROMPT))  # the state's recurrent arrays are new ones
    session = runner.sessions()[0]
    assert session.nbytes == buffer_bytes(session) == summed_bytes(session)


def test_a_checkpoint_of_copies_counts_both(qwen_gdn_install: Path) -> None:
    runner = open_runner(qwen_gdn_install, 1)
    serve_turn(runner, PROMPT)
    session = runner.sessions()[0]
    shared = session.nbytes
    first = session.checkpoints[0]
    copies = {
        name: {key: mx.array(np.array(a)) for key, a in snap.items()}
        for name, snap in first.snapshots.items()
    }
    session.checkpoints[0] = Checkpoint(first.position, copies)
    assert session.nbytes == buffer_bytes(session) == summed_bytes(session) > shared


def test_the_parked_cap_keeps_a_session_that_fits_when_counted_once(
    qwen_gdn_install: Path,
) -> None:
    """A cap of exactly one session's distinct bytes keeps it parked (its
    checkpoint shares the state's arrays); counted per holder it would not fit."""
    probe = open_runner(qwen_gdn_install, 1)
    serve_turn(probe, PROMPT)
    one_session = probe.session_nbytes()[0]
    assert summed_bytes(probe.sessions()[0]) > one_session

    runner = Runner.open(
        qwen_gdn_install, context_length=4096, session_slots=2, max_parked_bytes=one_session
    )
    runner.set_prefix_reuse(True)
    serve_turn(runner, PROMPT)
    serve_turn(runner, OTHER)  # parks the first conversation
    assert not runner.session_slot_evicted()
    assert runner.session_nbytes()[1] == one_session
    kept, _ = serve_turn(runner, [*PROMPT, 7])
    assert kept == len(PROMPT) and runner.last_reuse.swapped


@pytest.fixture(scope="module")
def wide_gdn_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen_gdn whose recurrent state outweighs its K/V (8 value heads of 64 x
    64 a layer), so a second copy of it shows in the memory in use."""
    path = tmp_path_factory.mktemp("qwen_gdn_wide")
    build_synthetic_install(
        "qwen_gdn", path, vocab_size=128, num_layers=4, model_id="tiny-qwen-wide-gdn",
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    )  # fmt: skip
    return path


def test_a_parked_session_keeps_no_undo_of_its_last_step(wide_gdn_install: Path) -> None:
    """A step that feeds a lazily sampled id holds the recurrent state from
    before it, to take the id back if it is a stop. Kept past the request
    (the engine's lone row) or the park (the library's produce), it was a
    second recurrent state in every parked session, counted nowhere: the
    memory in use beyond the sessions' bytes was half as much again."""
    runner = Runner.open(wide_gdn_install, context_length=1024, session_slots=3)
    codec = load_text(wide_gdn_install)
    config = GenerationConfig(max_tokens=8, temperature=0.0, stop_token_ids=[])

    def park_two(k: int) -> None:
        generate(runner, codec, [2, 3 + k, *range(10, 40)], config)
        assert runner.store.live.undo is None  # let go when the request ended, still live
        runner.reset()
        prompt = [2, 4 + k, *range(50, 70)]
        logits = runner.prefill_chunk(prompt, 0)
        runner.produce(mx.argmax(logits), len(prompt))
        runner.reset()

    park_two(0)  # the first builds what the process keeps (compiled steps, caches)
    runner.forget_sessions()
    before = memory_in_use()
    park_two(1)
    sessions = runner.sessions()
    assert sum(s.has_content for s in sessions) == 2
    held = sum(runner.session_nbytes())
    assert memory_in_use() - before <= held + held // 5
    assert all(s.undo is None for s in sessions)


def test_a_session_cut_far_back_counts_the_buffer_it_keeps(gemma4_install: Path) -> None:
    """A rewind keeps the K/V buffer (the next write fills it again), so a
    session cut from a thousand tokens to a dozen still holds its thousand
    rows: its bytes count the buffer, not the rows in use, and the parked
    cap sees what memory it takes."""
    runner = open_runner(gemma4_install, 2)
    prompt = [2, *((7 * i) % 100 + 10 for i in range(1000))]

    def park_cut(k: int) -> None:
        runner.prefill_chunk([*prompt[:-1], 3 + k], 0)
        runner.prefill_chunk([5, 6], 10)  # rewinds to 10 first
        assert runner.position == 12
        runner.reset()

    park_cut(0)  # the first builds what the process keeps (compiled steps, caches)
    runner.forget_sessions()
    before = memory_in_use()
    park_cut(1)
    parked = runner.sessions()[1]
    layers = [
        layer
        for c in parked.state.values()
        for layer in getattr(c, "layers", [])
        if layer.keys is not None
    ]
    assert layers and all(layer.fill == 12 and layer.keys.shape[2] > 1000 for layer in layers)
    held = sum(runner.session_nbytes())
    assert held == parked.nbytes
    assert held <= memory_in_use() - before <= held + held // 8
