"""The head-layout helpers of :mod:`turbospark.layers.attention`: one token
takes a single reshape where a prompt takes a reshape and a transpose, and
both give exactly the reference layout (float32 on CPU); one query's
attention without the fused op gives the fused op's output."""

from __future__ import annotations

import mlx.core as mx
import pytest

from turbospark.layers.attention import decode_attention, heads_first, merge_heads, normed_heads

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


@pytest.mark.parametrize("scale", [1.0, 0.125, 0.3])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_decode_attention_is_the_fused_op(scale: float, kv_heads: int) -> None:
    """Grouped heads, two rows, keys read as a slice of a larger buffer (as
    the K/V cache hands them out): the fused op's result to float32 rounding."""
    q = mx.random.normal((2, HEADS, 1, DIM), key=mx.random.key(3))
    buffer = mx.random.normal((2, kv_heads, 40, 2 * DIM), key=mx.random.key(4))
    keys, values = buffer[:, :, 3:29, :DIM], buffer[:, :, 3:29, DIM:]
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)
    got = decode_attention(q, keys, values, scale)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-6).item()
