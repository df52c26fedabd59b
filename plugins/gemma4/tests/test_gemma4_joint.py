"""One token's attention inputs from the stacked projection (q, k and v normed
in one pass, scaled and rotated together) against the per-projection form,
for both value layouts (own value heads, ``attention_k_eq_v``), float32."""

from __future__ import annotations

import mlx.core as mx
import pytest

from turbospark.layers.rope import rope_freqs
from turbospark_gemma4.model import attention_inputs, joint_inputs

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
    got = joint_inputs(qkv, joint, start, freqs, HEADS, KV_HEADS, EPS)
    for name, a, b in zip(("queries", "keys", "values"), got, want, strict=True):
        assert a.shape == b.shape, name
        assert mx.allclose(a, b, atol=1e-5).item(), name
