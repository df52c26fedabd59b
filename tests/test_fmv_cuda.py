"""The few-row float product kernel against float64 and against MLX's matmul.

Runs only where MLX has its CUDA backend (``TURBOSPARK_TEST_DEVICE=gpu
python3 -m pytest tests/test_fmv_cuda.py``); elsewhere a product is MLX's
matmul and ``tests/test_fmv_kernel_path.py`` checks which products
:func:`~turbospark.layers.stacked.matmul_t` hands the kernel. Here the
kernel's product is held to the exact product in float64 and to ``x @ w.T``:
the large sizes' widths and odd ones, 2 to :data:`~turbospark.layers.cuda.fmv.R_MAX`
rows, float32 and bfloat16; each row equal to the same row among others, bit
for bit (the same sums whatever the batch); views that start anywhere and
weights stored row-major (the scalar path); and the kernel inside a
compiled function.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from helpers import assert_product_near
from turbospark.layers.cuda import fmv as fmv_cuda

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")

# (outputs, inputs): the large sizes' q and down projections and the head's
# width, a row shorter than a block's pass, one ending mid-pass, outputs not a
# multiple of a block's, and a width that is no whole 16-byte load.
SHAPES = [(2048, 8192), (8192, 2048), (37, 384), (1001, 1416), (5, 100)]
ROWS = [fmv_cuda.R_MIN, 5, fmv_cuda.R_MAX]


@pytest.fixture(autouse=True)
def _gpu() -> None:
    mx.set_default_device(mx.gpu)


def _weight(outputs: int, width: int, dtype: mx.Dtype, seed: int) -> mx.array:
    weight = (mx.random.normal((outputs, width), key=mx.random.key(seed)) * 0.05).astype(dtype)
    mx.eval(weight)
    return weight


def _x(rows: int, width: int, dtype: mx.Dtype, seed: int) -> mx.array:
    return mx.random.normal((rows, 1, width), key=mx.random.key(seed + 1)).astype(dtype)


def _check(got: mx.array, x: mx.array, weight: mx.array) -> None:
    """*got* against float64 (the float32 sums' error, a millionth of the
    terms' sizes, plus one rounding to bfloat16 where the activations are) and
    against MLX's matmul (as close again, plus its own rounding)."""
    op = fmv_cuda.fmv_ops(x, weight.T)
    assert got.shape == op.shape and got.dtype == op.dtype == x.dtype
    x64 = np.array(x.astype(mx.float32), dtype=np.float64).reshape(-1, x.shape[-1])
    w64 = np.array(weight.astype(mx.float32), dtype=np.float64)
    exact = x64 @ w64.T
    size = np.abs(x64) @ np.abs(w64).T
    bf16 = x.dtype == mx.bfloat16
    bound = 1e-6 * size + (2.0**-8 if bf16 else 0.0) * np.abs(exact)
    assert_product_near(got, op, exact, bound, 2 * bound + (2.0**-8 if bf16 else 1e-5) * size)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_equal_float64_and_matmul(shape: tuple[int, int], rows: int, dtype: mx.Dtype) -> None:
    outputs, width = shape
    weight = _weight(outputs, width, dtype, seed=outputs)
    x = _x(rows, width, dtype, seed=width + rows)
    assert fmv_cuda.fits(x, weight.T)
    _check(fmv_cuda.fmv(x, weight.T), x, weight)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_a_row_is_the_same_among_any_rows(dtype: mx.Dtype) -> None:
    """Each row's sums are its own, in one order: a row's product is the same
    bits in a batch of two or of :data:`R_MAX` (a server's batch changes size)."""
    weight = _weight(1001, 1416, dtype, seed=3)
    x = _x(fmv_cuda.R_MAX, 1416, dtype, seed=4)
    got = fmv_cuda.fmv(x, weight.T)
    for r in range(0, fmv_cuda.R_MAX, 2):
        pair = fmv_cuda.fmv(x[r : r + 2], weight.T)
        assert mx.array_equal(got[r : r + 2], pair).item(), f"rows {r}, {r + 1}"


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_views_and_row_major_weights(dtype: mx.Dtype) -> None:
    """x a view that starts mid-row (no 16-byte loads), a weight stored ``(K, N)``
    row-major (its transpose view is what layers hold; this one takes the
    scalar path), and a weight view of every other row: each as its copy."""
    weight = _weight(300, 512, dtype, seed=5)
    wide = _x(4, 520, dtype, seed=6)
    x = wide[..., 3:515]
    _check(fmv_cuda.fmv(x, weight.T), x, weight)
    stored = mx.contiguous(weight.T)  # (K, N), row-major
    mx.eval(stored)
    _check(fmv_cuda.fmv(x, stored), x, weight)
    every_other = _weight(600, 512, dtype, seed=7)[::2]
    _check(fmv_cuda.fmv(x, every_other.T), x, every_other)


def test_inside_a_compiled_function() -> None:
    """Traced once, replayed: the same result as eager, for each batch size."""
    weight = _weight(2048, 2048, mx.bfloat16, seed=8)
    step = mx.compile(lambda x: fmv_cuda.fmv(x, weight.T) * 2)
    for rows in ROWS:
        x = _x(rows, 2048, mx.bfloat16, seed=rows)
        assert mx.array_equal(step(x), fmv_cuda.fmv(x, weight.T) * 2).item()
