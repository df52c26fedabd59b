"""The heads' one-kernel norm and RoPE against the ops it replaces.

Runs only where MLX has its CUDA backend (the H200 bench machine:
``TURBOSPARK_TEST_DEVICE=gpu python3 -m pytest tests/test_heads_cuda.py``); on
the CPU a step takes :func:`~turbospark.layers.cuda.heads.norm_rope_ops`,
which ``tests/test_attention_kernel_path.py`` runs through Gemma 4's layer
traces. The layer traces with this kernel against the modules' path on the
same GPU are ``tests/test_attention_cuda.py``'s.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark.layers.cuda import heads as heads_cuda
from turbospark.layers.rope import rope_freqs

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")

EPS = 1e-6
# (query heads, key heads, own value heads, head dim, proportional RoPE): Gemma 4's
# sliding and full K/V-owning layers (the full one attention_k_eq_v), then the
# KV-shared layers' queries alone.
LAYOUTS = [
    (8, 2, True, 256, False),
    (8, 2, False, 512, True),
    (8, 0, False, 256, False),
    (8, 0, False, 512, True),
]


def _inputs(
    heads: int, kv_heads: int, own_values: bool, dim: int, partial: bool, dtype: mx.Dtype
) -> tuple[mx.array, mx.array, mx.array]:
    keys = mx.random.split(mx.random.key(dim + kv_heads + own_values), 3)
    n_in = heads + kv_heads * (2 if own_values else 1)
    x = mx.random.normal((3, n_in * dim), key=keys[0]) * 3
    q_w = 1 + mx.random.normal((dim,), key=keys[1]) * 0.2
    k_w = 1 + mx.random.normal((dim,), key=keys[2]) * 0.2
    parts = [mx.broadcast_to(q_w, (heads, dim)), mx.broadcast_to(k_w, (kv_heads, dim))]
    table = mx.concatenate(parts)[:, None]  # (heads + kv_heads, 1, D)
    freqs = rope_freqs(dim, 1e6, dim // 4, 1.0) if partial else rope_freqs(dim, 1e4)
    return x.astype(dtype), table.astype(dtype), freqs


@pytest.mark.parametrize(("heads", "kv_heads", "own_values", "dim", "partial"), LAYOUTS)
@pytest.mark.parametrize("position", [0, 37, 3001])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_equals_its_ops(
    heads: int,
    kv_heads: int,
    own_values: bool,
    dim: int,
    partial: bool,
    position: int,
    dtype: mx.Dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mx.set_default_device(mx.gpu)
    x, table, freqs = _inputs(heads, kv_heads, own_values, dim, partial, dtype)
    start = mx.array(position, dtype=mx.int32)
    args = (x, table, start, freqs, heads, kv_heads, EPS)
    want = heads_cuda.norm_rope_ops(*args)
    ops = heads_cuda.norm_rope_ops

    def refused(*a: object) -> None:
        raise AssertionError("took the ops, not the kernel")

    monkeypatch.setattr(heads_cuda, "norm_rope_ops", refused)
    got = heads_cuda.norm_rope(*args)
    monkeypatch.setattr(heads_cuda, "norm_rope_ops", ops)
    assert len(got) == len(want) == (3 if kv_heads else 1)
    # The same roundings; a head's float32 sum of squares in another order and
    # CUDA's cos and sin move a bfloat16 value by at most a unit in its last place.
    tolerance = 1e-5 if dtype == mx.float32 else 2**-7
    for name, a, b in zip(("queries", "keys", "values"), got, want, strict=False):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance, err_msg=name)


def test_a_row_is_the_same_alone() -> None:
    """Each block reads only its own row and head, bit for bit."""
    mx.set_default_device(mx.gpu)
    x, table, freqs = _inputs(8, 2, True, 256, False, mx.bfloat16)
    start = mx.array(100, dtype=mx.int32)
    together = heads_cuda.norm_rope(x, table, start, freqs, 8, 2, EPS)
    alone = heads_cuda.norm_rope(x[1:2], table, start, freqs, 8, 2, EPS)
    for a, b in zip(alone, together, strict=True):
        assert mx.array_equal(a, b[1:2]).item()


def test_what_the_kernel_does_not_take_keeps_the_ops() -> None:
    """A weight of another dtype, a head dim whose pairs do not fill warps,
    and several tokens a row take the ops, equal to them bit for bit."""
    mx.set_default_device(mx.gpu)
    x, table, freqs = _inputs(8, 2, True, 256, False, mx.bfloat16)
    start = mx.array(9, dtype=mx.int32)
    small_x, small_table, small_freqs = _inputs(4, 2, True, 32, False, mx.float32)
    cases = [
        (x, table.astype(mx.float32), start, freqs, 8, 2, EPS),
        (small_x, small_table, start, small_freqs, 4, 2, EPS),
        (x.reshape(3, 1, -1), table, start, freqs, 8, 2, EPS),
    ]
    for args in cases:
        got, want = heads_cuda.norm_rope(*args), heads_cuda.norm_rope_ops(*args)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
