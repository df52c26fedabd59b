"""A session's bytes count each buffer it holds once.

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

from helpers import open_runner, serve_turn
from turbospark import Runner
from turbospark.sessions.session import Checkpoint, Session
from turbospark.state.components import state_nbytes

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
