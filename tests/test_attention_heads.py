"""The head-layout helpers of :mod:`turbospark.layers.attention`: one token
takes a single reshape where a prompt takes a reshape and a transpose, and
both give exactly the reference layout (float32 on CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from turbospark.layers.attention import heads_first, merge_heads, normed_heads

BATCH, HEADS, DIM = 3, 4, 8


@pytest.mark.parametrize("length", [1, 5])
def test_heads_first_and_merge_are_the_reference_reshapes(length: int) -> None:
    x = mx.random.normal((BATCH, length, HEADS * DIM), key=mx.random.key(0))
    want = x.reshape(BATCH, length, HEADS, DIM).transpose(0, 2, 1, 3)
    got = heads_first(x, HEADS)
    assert got.shape == want.shape and mx.array_equal(got, want).item()
    assert mx.array_equal(merge_heads(got), x).item()


@pytest.mark.parametrize("length", [1, 5])
@pytest.mark.parametrize("scaled", [True, False])
def test_normed_heads_is_the_norm_then_the_transpose(length: int, scaled: bool) -> None:
    x = mx.random.normal((BATCH, length, HEADS * DIM), key=mx.random.key(1))
    weight = mx.random.normal((DIM,), key=mx.random.key(2)) if scaled else None
    reference = mx.fast.rms_norm(x.reshape(BATCH, length, HEADS, DIM), weight, 1e-6)
    want = reference.transpose(0, 2, 1, 3)
    got = normed_heads(x, HEADS, weight, 1e-6)
    assert got.shape == want.shape and mx.array_equal(got, want).item()
