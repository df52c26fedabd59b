"""Batched K/V against a plain list per row, under random joins, leaves and steps.

:class:`turbospark.state.kv.BatchLayerKV` builds new buffers with headroom when
sessions merge, join (``extend``) and leave (``filter``), and right-aligns
rows at different lengths. Whatever the schedule, each row extracted must hold
exactly the columns it was given, in order (a windowed row at least its
retained tail), and a decode step must see exactly its own columns within
the window: never padding, never another row's. A ragged feed (rows of
different lengths in one write, the shorter padded past their end, then
``shift``) must leave the same.
"""

from __future__ import annotations

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark.layers.attention import padding_bias
from turbospark.state.kv import BatchLayerKV, LayerKV

HEADS, DIM = 2, 3


def column(value: float) -> mx.array:
    return mx.full((1, HEADS, 1, DIM), value, mx.float32)


def session(values: list[float], window: int | None) -> LayerKV:
    layer = LayerKV(window, 1 if window else 0)
    if values:
        keys = mx.concatenate([column(v) for v in values], axis=2)
        layer.keys, layer.values, layer.fill = keys, -keys, len(values)
    return layer


def written(layer: LayerKV) -> list[float]:
    if layer.keys is None:
        return []
    assert mx.array_equal(layer.values[:, :, : layer.fill], -layer.keys[:, :, : layer.fill])
    return layer.keys[0, 0, : layer.fill, 0].tolist()


operations = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(0, 0)),
        st.tuples(st.just("join"), st.integers(0, 6)),
        st.tuples(st.just("leave"), st.integers(0, 2**16)),
        st.tuples(st.just("ragged"), st.integers(0, 2**16)),
    ),
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(
    first=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    schedule=operations,
    window=st.sampled_from([None, 3]),
)
def test_rows_hold_what_they_were_given_whatever_the_schedule(first, schedule, window):
    counter = iter(range(1, 10**6))
    rows = [[float(next(counter)) for _ in range(n)] for n in first]
    batch = BatchLayerKV.merge([session(r, window) for r in rows])
    for op, arg in schedule:
        if op == "step":
            new = [float(next(counter)) for _ in rows]
            step = mx.concatenate([column(v) for v in new], axis=0)
            batch.prepare(1)
            keys, _, start = batch.update_and_fetch(step, -step)
            mask = batch.mask(1, start, keys.shape[2])
            for i, row in enumerate(rows):
                row.append(new[i])
                visible = (
                    keys[i, 0, :, 0].tolist() if mask is None else
                    [v for v, m in zip(keys[i, 0, :, 0].tolist(), mask[i, 0, 0].tolist(), strict=True) if m]
                )  # fmt: skip
                assert visible == (row if window is None else row[-window:])
        elif op == "join":
            joining = [float(next(counter)) for _ in range(arg)]
            batch.extend(BatchLayerKV.merge([session(joining, window)]))
            rows.append(joining)
        elif op == "ragged":  # 1-4 new columns a row, padded to the longest, then shifted
            counts = [1 + (arg >> (2 * i) & 3) for i in range(len(rows))]
            width = max(counts)
            new = [[float(next(counter)) for _ in range(n)] for n in counts]
            step = mx.concatenate(
                [mx.concatenate([column(v) for v in [*got, *[-1.0] * (width - len(got))]], axis=2) for got in new],
                axis=0,
            )  # fmt: skip
            batch.prepare(width)
            batch.update_and_fetch(step, -step)
            batch.shift([width - n for n in counts])
            for row, got in zip(rows, new, strict=True):
                row.extend(got)
        elif len(rows) > 1:  # leave: a random non-empty subset stays, in order
            stay = [i for i in range(len(rows)) if arg >> i & 1] or [len(rows) - 1]
            batch.filter(stay)
            rows = [rows[i] for i in stay]
    for i, row in enumerate(rows):
        kept = written(batch.extract(i, len(row), 0))
        assert kept == row[len(row) - len(kept) :]
        assert len(kept) >= (len(row) if window is None else min(len(row), batch.retain))


def test_a_steps_layers_share_one_padding_mask_and_one_bias():
    """Layers that fetched the same columns in a decode step get one mask array
    (built once a step, not once a layer), and attention's bias for it is one
    array too; a step one column on gets a new mask, and it hides the padding."""

    def merged() -> BatchLayerKV:
        layer = BatchLayerKV.merge([session([1.0, 2.0], None), session([3.0], None)])
        step = mx.repeat(column(9.0), 2, axis=0)
        layer.update_and_fetch(step, step)
        return layer

    first, second = merged(), merged()  # two layers of one step
    mask = first.mask(1, 0, first.fill)
    assert mask is second.mask(1, 0, second.fill)
    assert mask[:, 0, 0].tolist() == [[True, True, True], [False, True, True]]
    shape = (2, HEADS, 1, first.fill)
    assert padding_bias(mask, shape, mx.float32) is padding_bias(mask, shape, mx.float32)
    assert padding_bias(mask, shape, mx.float32)[1, 0, 0].tolist()[0] == float("-inf")
    step = mx.repeat(column(8.0), 2, axis=0)
    first.update_and_fetch(step, step)
    later = first.mask(1, 0, first.fill)
    assert later is not mask and later[:, 0, 0].tolist() == [
        [True, True, True, True],
        [False, True, True, True],
    ]


def test_a_shift_left_undoes_a_shift_right():
    """A ragged forward that fails after the shift shifts back: every row's
    columns up to its old end come back (the padding past it is lost)."""
    batch = BatchLayerKV.merge([session([1.0, 2.0, 3.0], None), session([4.0], None)])
    step = mx.concatenate([column(5.0), column(6.0)], axis=0)
    batch.update_and_fetch(step, -step)
    before = [written(batch.extract(i, n, 0)) for i, n in enumerate([4, 2])]
    batch.shift([0, 1])
    assert [written(batch.extract(i, n, 0)) for i, n in enumerate([4, 1])] == [before[0], [4.0]]
    batch.shift([0, -1])
    assert [written(batch.extract(i, n, 0)) for i, n in enumerate([4, 2])] == before
