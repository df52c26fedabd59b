"""The head-layout helpers of :mod:`turbospark.layers.attention`: one token
takes a single reshape where a prompt takes a reshape and a transpose, and
both give exactly the reference layout (float32 on CPU); attention without
the fused op (one query, or several under every mask the KV layers build)
gives the fused op's output."""

from __future__ import annotations

import mlx.core as mx
import pytest

from turbospark.layers import fused
from turbospark.layers.attention import (
    decode_attention,
    heads_first,
    matmul_attention,
    merge_heads,
    normed_heads,
)

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


def _mask(kind: str, rows: int, length: int, keys: int) -> mx.array | str:
    """The masks the KV layers hand attention for *length* queries over *keys*."""
    if kind == "causal":
        return "causal"
    q_pos = mx.arange(keys - length, keys)[:, None]
    visible = q_pos >= mx.arange(keys)[None]
    if kind == "window":  # LayerKV's sliding window, (L, T)
        return visible & (q_pos - mx.arange(keys)[None] < 6)
    left = mx.array([0, 4, 9][:rows])[:, None, None, None]  # BatchLayerKV's padding, (B, 1, L, T)
    return visible[None, None] & (mx.arange(keys)[None, None, None] >= left)


@pytest.mark.parametrize("mask", ["causal", "window", "batch"])
@pytest.mark.parametrize(("rows", "length"), [(1, 3), (1, 12), (3, 5), (3, 1 + fused.STEP_TOKENS)])
@pytest.mark.parametrize(("scale", "kv_heads"), [(1.0, 1), (0.3, 2), (0.125, 4)])
def test_matmul_attention_is_the_fused_op(
    mask: str, rows: int, length: int, scale: float, kv_heads: int
) -> None:
    """Several queries a row (a verify pass, a prefill chunk, a batched
    prefill group), each mask a KV layer builds, keys read from a larger
    buffer: the fused op's result to float32 rounding."""
    keys_in = 30
    q = mx.random.normal((rows, HEADS, length, DIM), key=mx.random.key(5))
    buffer = mx.random.normal((rows, kv_heads, 40, 2 * DIM), key=mx.random.key(6))
    keys, values = buffer[:, :, 2 : 2 + keys_in, :DIM], buffer[:, :, 2 : 2 + keys_in, DIM:]
    m = _mask(mask, rows, length, keys_in)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=m)
    got = matmul_attention(q, keys, values, scale, m)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-6).item()


def test_scores_past_the_bound_take_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA's forms, several queries take matmul_attention up to
    MATMUL_SCORES scores and the op past it (a long chunk over a long context)."""
    from turbospark.layers import attention

    calls: list[str] = []
    monkeypatch.setattr(fused, "BUILD_FOR_GPU", True)
    monkeypatch.setattr(attention, "_FUSED_DECODE", False)
    monkeypatch.setattr(attention, "op_holds_scores", lambda *a: False)  # cuDNN's head dims
    monkeypatch.setattr(attention, "matmul_attention", lambda *a: calls.append("matmul"))
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", lambda *a, **k: calls.append("op"))
    q = mx.zeros((1, HEADS, 5, DIM))
    kv = mx.zeros((1, 2, 30, DIM))
    monkeypatch.setattr(attention, "MATMUL_SCORES", HEADS * 5 * 30)
    attention.attend(q, kv, kv, 1.0, "causal")
    monkeypatch.setattr(attention, "MATMUL_SCORES", HEADS * 5 * 30 - 1)
    attention.attend(q, kv, kv, 1.0, "causal")
    assert calls == ["matmul", "op"]


@pytest.mark.parametrize("gpu_forms", [False, True])
@pytest.mark.parametrize(("length", "keys_in", "budget"), [(12, 12, 5), (7, 30, 3), (9, 30, 1)])
def test_causal_blocks_are_the_whole_chunk(
    monkeypatch: pytest.MonkeyPatch, gpu_forms: bool, length: int, keys_in: int, budget: int
) -> None:
    """A ``"causal"`` chunk past the scores bound, where the op would hold
    every score (the CPU; wide heads on a GPU), attends a block of queries at
    a time, each over the keys it sees: the whole chunk's output to float32
    rounding, a first chunk (as many keys as queries) and a later one, blocks
    of a few rows and of one."""
    from turbospark.layers import attention

    monkeypatch.setattr(fused, "BUILD_FOR_GPU", gpu_forms)
    monkeypatch.setattr(attention, "_FUSED_DECODE", False)
    q = mx.random.normal((1, HEADS, length, DIM), key=mx.random.key(7))
    buffer = mx.random.normal((1, 2, 40, 2 * DIM), key=mx.random.key(8))
    keys, values = buffer[:, :, :keys_in, :DIM], buffer[:, :, :keys_in, DIM:]
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.3, mask="causal")
    blocks: list[int] = []
    whole = attention.causal_blocks

    def spy(*args: object) -> mx.array:
        blocks.append(args[-1])  # type: ignore[arg-type]
        return whole(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "causal_blocks", spy)
    monkeypatch.setattr(attention, "BLOCK_SCORES", HEADS * keys_in * budget)
    got = attention.attend(q, keys, values, 0.3, "causal")
    assert blocks == [max(1, budget)]
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-6).item()


def test_blocks_evaluated_one_at_a_time_are_the_blocks_queued_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a GPU's forward evaluates each block before queuing the next, the
    output is the lazily chained blocks', bit for bit, one evaluation a block."""
    from turbospark.layers import attention

    q = mx.random.normal((1, HEADS, 9, DIM), key=mx.random.key(7))
    buffer = mx.random.normal((1, 2, 30, 2 * DIM), key=mx.random.key(8))
    keys, values = buffer[..., :DIM], buffer[..., DIM:]
    monkeypatch.setattr(attention, "evaluates_blocks", lambda batch, length: False)
    lazy = attention.causal_blocks(q, keys, values, 0.3, 2)
    evaluated: list[tuple[int, ...]] = []
    real_eval = mx.eval
    monkeypatch.setattr(attention, "evaluates_blocks", lambda batch, length: True)
    monkeypatch.setattr(mx, "eval", lambda *a: (evaluated.append(a[0].shape), real_eval(*a)))
    one_at_a_time = attention.causal_blocks(q, keys, values, 0.3, 2)
    monkeypatch.undo()
    assert evaluated == [(1, HEADS, 2, DIM)] * 4 + [(1, HEADS, 1, DIM)]
    assert mx.array_equal(one_at_a_time, lazy).item()


def test_only_an_uncompiled_forward_on_a_gpu_evaluates_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from turbospark.layers import attention

    assert not attention.evaluates_blocks(1, 512)  # the CPU holds one block at a time anyway
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert attention.evaluates_blocks(1, 512) and attention.evaluates_blocks(3, 2)
    assert not attention.evaluates_blocks(1, 1)  # traced: a decode step, a verify pass
    assert not attention.evaluates_blocks(1, fused.STEP_TOKENS)


def test_a_chunk_within_the_bound_takes_the_op_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within BLOCK_SCORES (every chat-sized prompt) nothing is blocked."""
    from turbospark.layers import attention

    calls: list[int] = []
    monkeypatch.setattr(attention, "causal_blocks", lambda *a: calls.append(a[-1]))
    q, kv = mx.zeros((1, HEADS, 5, DIM)), mx.zeros((1, 2, 30, DIM))
    monkeypatch.setattr(attention, "BLOCK_SCORES", HEADS * 5 * 30)
    attention.attend(q, kv, kv, 1.0, "causal")
    assert calls == []
    monkeypatch.setattr(attention, "BLOCK_SCORES", HEADS * 4 * 30)
    attention.attend(q, kv, kv, 1.0, "causal")
    assert calls == [4]
