"""The one-kernel residual join and its norms against the ops they replace.

Runs only where MLX has its CUDA backend (the H200 bench machine:
``TURBOSPARK_TEST_DEVICE=gpu python3 -m pytest tests/test_norm_cuda.py``); on
the CPU and Metal the families keep their ops, and
``tests/test_norm_kernel_path.py`` runs the families' kernel path with the
ops standing in. Whole forwards with the kernel against the reference forms
on the same GPU are ``tests/test_prefill_gpu_forms.py`` and
``tests/test_verify_gpu_forms.py``.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from turbospark.layers.cuda import norm as norm_cuda

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")

FLAGS = list(itertools.product((False, True), repeat=3))  # update norm, scale, norm


def _inputs(shape: tuple[int, ...], dtype: mx.Dtype, seed: int) -> list[mx.array]:
    keys = mx.random.split(mx.random.key(seed), 5)
    width = shape[-1]
    h = mx.random.normal(shape, key=keys[0]) * 3
    update = mx.random.normal(shape, key=keys[1]) * 5
    update_weight = 1 + mx.random.normal((width,), key=keys[2]) * 0.2
    weight = 1 + mx.random.normal((width,), key=keys[3]) * 0.2
    scale = mx.random.uniform(0.5, 1.5, (1,), key=keys[4])
    return [x.astype(dtype) for x in (h, update, update_weight, scale, weight)]


@pytest.mark.parametrize(("has_uw", "has_scale", "has_w"), FLAGS)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 1, 64), (2, 5, 100), (1, 7, 6144)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernel_equals_its_ops(
    has_uw: bool, has_scale: bool, has_w: bool, shape: tuple[int, ...], dtype: mx.Dtype
) -> None:
    mx.set_default_device(mx.gpu)
    h, update, uw, scale, w = _inputs(shape, dtype, seed=shape[-1] + has_uw)
    args = (h, update, w if has_w else None, 1e-6, uw if has_uw else None)
    kwargs = {"scale": scale if has_scale else None}
    got = norm_cuda.join_norm(*args, **kwargs)
    want = norm_cuda.join_norm_ops(*args, **kwargs)
    assert (got[1] is None) == (not has_w) == (want[1] is None)
    # The same roundings; only the order of a row's float32 sum of squares differs,
    # which moves a bfloat16 value by at most one unit in its last place.
    tolerance = 1e-5 if dtype == mx.float32 else 2**-7
    for a, b in zip(got, want, strict=True):
        if b is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)


def test_a_row_is_the_same_alone_and_batched() -> None:
    """Each block reads only its own row: a row's outputs do not depend on the
    rows beside it, bit for bit."""
    mx.set_default_device(mx.gpu)
    h, update, uw, scale, w = _inputs((4, 3, 2048), mx.bfloat16, seed=3)
    joined, normed = norm_cuda.join_norm(h, update, w, 1e-6, uw, scale)
    alone, alone_normed = norm_cuda.join_norm(h[2:3, 1:2], update[2:3, 1:2], w, 1e-6, uw, scale)
    assert mx.array_equal(alone, joined[2:3, 1:2])
    assert mx.array_equal(alone_normed, normed[2:3, 1:2])


def test_mixed_dtypes_take_the_ops() -> None:
    """A weight of another dtype than the activations takes the ops (which
    promote as MLX does), not a kernel built for one dtype."""
    mx.set_default_device(mx.gpu)
    h, update, _, _, w = _inputs((1, 1, 256), mx.bfloat16, seed=5)
    got = norm_cuda.join_norm(h, update, w.astype(mx.float32), 1e-6)
    want = norm_cuda.join_norm_ops(h, update, w.astype(mx.float32), 1e-6)
    assert all(mx.array_equal(a, b) for a, b in zip(got, want, strict=True))
