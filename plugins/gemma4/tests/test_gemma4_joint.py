"""One token's attention inputs from the stacked projection (q, k and v normed
in one pass, scaled and rotated together: ``heads_cuda.norm_rope_ops``, the
ops of the heads' CUDA kernel) against the per-projection form, for both
value layouts (own value heads, ``attention_k_eq_v``) and a KV-shared layer's
queries alone, float32."""

from __future__ import annotations

import mlx.core as mx
import pytest

from turbospark.sdk import norm_rope_ops, rope_freqs
from turbospark_gemma4.model import attention_inputs

HEADS, KV_HEADS, DIM, EPS = 4, 2, 16, 1e-6


@pytest.mark.parametrize("k_eq_v", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_joint_inputs_are_the_separate_inputs(k_eq_v: bool, batch: int) -> None:
    width = (HEADS + KV_HEADS * (1 if k_eq_v else 2)) * DIM
    qkv = mx.random.normal((batch, 1, width), key=mx.random.key(0))
    q_w, k_w = (mx.random.normal((DIM,), key=mx.random.key(i)) for i in (1, 2))
    start = mx.array([7, 30, 2][:batch]) if batch > 1 else mx.array(11)
    freqs = rope_freqs(DIM, 10_000.0, DIM // 2)  # partial: the proportional kind
    q, k = qkv[..., : HEADS * DIM], qkv[..., HEADS * DIM : (HEADS + KV_HEADS) * DIM]
    v = None if k_eq_v else qkv[..., (HEADS + KV_HEADS) * DIM :]
    want = attention_inputs(q, k, v, (q_w, k_w), start, freqs, HEADS, KV_HEADS, DIM, EPS)
    joint = mx.concatenate(
        [mx.broadcast_to(q_w, (HEADS, DIM)), mx.broadcast_to(k_w, (KV_HEADS, DIM))]
    )[:, None]
    got = norm_rope_ops(qkv, joint, start, freqs, HEADS, KV_HEADS, EPS)
    for name, a, b in zip(("queries", "keys", "values"), got, want, strict=True):
        assert a.shape == b.shape, name
        assert mx.allclose(a, b, atol=1e-5).item(), name


def test_a_shared_layers_queries_are_the_separate_ones() -> None:
    """Without key heads (``kv_heads`` 0) the queries alone, from a step's
    ``(B, n*D)`` row as the layer traces hand it."""
    q = mx.random.normal((1, HEADS * DIM), key=mx.random.key(3))
    q_w = mx.random.normal((DIM,), key=mx.random.key(4))
    start, freqs = mx.array(19), rope_freqs(DIM, 10_000.0)
    (want, _, _) = attention_inputs(
        q[None], None, None, (q_w, None), start, freqs, HEADS, 0, DIM, EPS
    )
    table = mx.broadcast_to(q_w, (HEADS, DIM))[:, None]
    (got,) = norm_rope_ops(q, table, start, freqs, HEADS, 0, EPS)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()
