"""qwen4_exp's batched forward against each session alone, and what it refuses.

The conformance kit steps a batch one token at a time; here a batch of
sessions at different positions takes several tokens a row in one forward
(``logits="all"``): all rows still dense (one masked attention over the
left-padded K/V), and rows on both sides of the QSA budget (each row attends
alone, over its own columns and block selection). Every row's logits equal
the same chunk fed to the same session alone. Then the batched index and
tails on their own under hypothesis schedules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark.sdk import (
    InvalidInput,
    RewindError,
    State,
    build_synthetic_install,
    family_hooks,
    load_weights,
    read_manifest,
)
from turbospark_qwen4_exp.model import Qwen4ExpConfig
from turbospark_qwen4_exp.state import (
    BatchQSA,
    BatchStreamTail,
    LayerIndex,
    QSAComponent,
    StreamTail,
)

ATOL = 2e-4
# Synthetic budget (blocks of 4, top 2, window 4): dense through position 14.
TOKENS = [(5 * i * i + 7 * i + 3) % 128 for i in range(64)]


def _hook() -> Any:
    return family_hooks("qwen4_exp")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen4ExpConfig, nn.Module]:
    path: Path = tmp_path_factory.mktemp("qwen4_exp_batch")
    build_synthetic_install("qwen4_exp", path, vocab_size=128, model_id="tiny")
    manifest = read_manifest(path)
    arch = Qwen4ExpConfig.model_validate({**manifest.arch, "family": "qwen4_exp"})
    model = _hook().turbospark_load_model(
        arch=arch, weights=load_weights(path, manifest), dtype=mx.float32, experts=None
    )
    return arch, model


def _session(loaded: tuple[Qwen4ExpConfig, nn.Module], history: list[int]) -> State:
    arch, model = loaded
    state = _hook().turbospark_new_state(arch=arch, model=model, context_length=4096)
    if history:
        _hook().turbospark_forward(
            model=model, tokens=mx.array(history, dtype=mx.int32), start=0, state=state,
            vision=None, logits="none", steer=None,
        )  # fmt: skip
    return state


def _merge(states: list[State]) -> State:
    return {name: type(c).merge([s[name] for s in states]) for name, c in states[0].items()}


def _batched(model: nn.Module, batch: State, chunks: list[list[int]], positions: list[int]) -> Any:
    for component in batch.values():
        component.prepare(len(chunks[0]))
    return _hook().turbospark_forward_batch(
        model=model, tokens=mx.array(chunks, dtype=mx.int32), positions=positions,
        state=batch, logits="all", steer=None,
    )  # fmt: skip


@pytest.mark.parametrize(
    "lengths",
    [(2, 5, 3), (3, 18, 11, 25)],
    ids=["all rows dense", "rows on both sides of the budget"],
)
def test_a_batched_chunk_equals_each_session_fed_alone(loaded, lengths):
    _, model = loaded
    histories = [TOKENS[i : i + n] for i, n in enumerate(lengths)]
    batch = _merge([_session(loaded, h) for h in histories])
    for step in range(3):  # three chunks of 3: the rows cross block boundaries
        chunks = [TOKENS[30 + 3 * step + i : 33 + 3 * step + i] for i in range(len(lengths))]
        got = _batched(model, batch, chunks, [len(h) for h in histories])
        for i, history in enumerate(histories):
            alone = _session(loaded, history)
            want = _hook().turbospark_forward(
                model=model, tokens=mx.array(chunks[i], dtype=mx.int32), start=len(history),
                state=alone, vision=None, logits="all", steer=None,
            )  # fmt: skip
            np.testing.assert_allclose(np.array(got[i]), np.array(want), atol=ATOL)
            histories[i] = [*history, *chunks[i]]


def test_a_batched_step_at_the_wrong_positions_is_refused_before_anything_moves(loaded):
    _, model = loaded
    histories = [TOKENS[:5], TOKENS[:9]]
    batch = _merge([_session(loaded, h) for h in histories])
    before = {name: [np.array(a) for a in c.arrays()] for name, c in batch.items()}
    fills = batch["qsa"].hold()
    for positions, message in [
        ([5, 8], "batch row 1 is at position 9, asked to write at 8; pass each row's own position"),
        ([5], "a qwen4_exp batch of 2 rows was given 1 positions; pass one position per row"),
    ]:
        with pytest.raises(InvalidInput, match=message):
            _batched(model, batch, [[1], [2]], positions)
    assert batch["qsa"].hold() == fills
    for name, component in batch.items():
        after = [np.array(a) for a in component.arrays()]
        assert len(after) == len(before[name])
        for a, b in zip(after, before[name], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_tail_row_goes_back_only_by_the_whole_step_held(loaded):
    """A non-rewindable tail leaves a step back from the tail held before it,
    and refuses any other distance by name rather than guess."""
    _, model = loaded
    batch = _merge([_session(loaded, TOKENS[:4]), _session(loaded, TOKENS[:6])])
    tails = batch["ngram_context"]
    assert isinstance(tails, BatchStreamTail) and isinstance(batch["qsa"], BatchQSA)
    for component in batch.values():
        component.prepare(1)
    held = tails.hold()
    _hook().turbospark_forward_batch(
        model=model, tokens=mx.array([[9], [10]], dtype=mx.int32), positions=[4, 6],
        state=batch, logits="last", steer=None,
    )  # fmt: skip
    back = tails.extract(1, 6, 1, held)
    assert back.tail.tolist() == _session(loaded, TOKENS[:6])["ngram_context"].tail.tolist()
    assert back.position == 6
    with pytest.raises(RewindError, match="'ngram_context' can rewind at most 1 token"):
        tails.extract(1, 5, 2, held)
    with pytest.raises(RewindError, match="'ngram_context' can rewind at most 0 token"):
        tails.extract(1, 6, 1, None)


# -- the batched components alone, under random schedules ----------------------

BLOCK = 2
PAD = 7  # the n-gram context's id before the first token


def _one_row(values: list[float]) -> tuple[LayerIndex, StreamTail]:
    index, tail = LayerIndex(BLOCK), StreamTail("ngram_context", mx.full((2,), PAD, mx.int32))
    if values:
        index.append(mx.array([[v, -v] for v in values], dtype=mx.float32))
        tail.push(mx.array([[int(v) for v in values]], dtype=mx.int32))
    return index, tail


def _expect(index: LayerIndex, tail: StreamTail, values: list[float], where: str) -> None:
    """*index* and *tail* hold exactly what a one-row run over *values* holds."""
    assert index.fill == len(values), where
    keys = [] if index.keys is None else index.keys[: index.fill, 0].tolist()
    assert keys == values, where
    blocks = len(values) // BLOCK
    if blocks:
        means = [sum(values[b * BLOCK : (b + 1) * BLOCK]) / BLOCK for b in range(blocks)]
        assert index.pooled[:blocks, 0].tolist() == pytest.approx(means), where
    assert tail.tail.tolist() == ([PAD, PAD] + [int(v) for v in values])[-2:], where


@settings(max_examples=60, deadline=None)
@given(
    first=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    schedule=st.lists(
        st.one_of(
            st.tuples(st.just("step"), st.integers(0, 0)),
            st.tuples(st.just("fail"), st.integers(0, 0)),
            st.tuples(st.just("join"), st.integers(0, 5)),
            st.tuples(st.just("leave"), st.integers(0, 2**8)),
            st.tuples(st.just("back"), st.integers(0, 2**8)),
        ),
        max_size=14,
    ),
)
def test_batched_index_and_tails_hold_each_row_whatever_the_schedule(first, schedule):
    """Joins, leaves, steps, failed steps (rolled back) and rows leaving one
    token back: every row always holds exactly its own keys, block means and
    tail, and the sessions merged in are never changed by the batch."""
    counter = iter(range(1, 10**6))
    rows = [[float(next(counter)) for _ in range(n)] for n in first]
    sessions = [_one_row(r) for r in rows]
    originals = [(list(r), s) for r, s in zip(rows, sessions, strict=True)]
    qsa = QSAComponent.merge([_component(index) for index, _ in sessions])
    tails = StreamTail.merge([tail for _, tail in sessions])

    def step() -> tuple[object, object]:
        for component in (qsa, tails):
            component.prepare(1)
        held = (qsa.hold(), tails.hold())
        new = [float(next(counter)) for _ in rows]
        for i, index in enumerate(qsa[0]):
            index.append(mx.array([[new[i], -new[i]]], dtype=mx.float32))
        tails.push(mx.array([[int(v)] for v in new], dtype=mx.int32))
        for row, value in zip(rows, new, strict=True):
            row.append(value)
        return held

    for op, arg in schedule:
        if op == "step":
            step()
        elif op == "fail":  # a forward that raised after writing: undone from what was held
            before = [list(r) for r in rows]
            held = step()
            qsa.rollback(held[0])
            tails.rollback(held[1])
            rows[:] = before
        elif op == "join":
            joining = [float(next(counter)) for _ in range(arg)]
            index, tail = _one_row(joining)
            originals.append((list(joining), (index, tail)))
            qsa.extend(QSAComponent.merge([_component(index)]))
            tails.extend(StreamTail.merge([tail]))
            rows.append(joining)
        elif op == "leave" and len(rows) > 1:
            stay = [i for i in range(len(rows)) if arg >> i & 1] or [0]
            qsa.filter(stay)
            tails.filter(stay)
            rows[:] = [rows[i] for i in stay]
        elif op == "back" and len(rows) > 1:  # a stop id fed: the row leaves one token back
            going = arg % len(rows)
            held = step()
            out_qsa = qsa.extract(going, len(rows[going]) - 1, 1, held[0])
            out_tail = tails.extract(going, len(rows[going]) - 1, 1, held[1])
            _expect(out_qsa[0], out_tail, rows[going][:-1], f"row {going} leaving a token back")
            stay = [i for i in range(len(rows)) if i != going]
            qsa.filter(stay)
            tails.filter(stay)
            rows[:] = [rows[i] for i in stay]
    for i, row in enumerate(rows):
        out_qsa = qsa.extract(i, len(row), 0, None)
        out_tail = tails.extract(i, len(row), 0, (tails.tail, 0))
        assert out_qsa.position == out_tail.position == len(row)
        _expect(out_qsa[0], out_tail, row, f"row {i} at the end")
    for values, (index, tail) in originals:
        _expect(index, tail, values, "a session merged into the batch")


def _component(index: LayerIndex) -> QSAComponent:
    component = QSAComponent(0, BLOCK)
    component.layers = [index]
    return component
