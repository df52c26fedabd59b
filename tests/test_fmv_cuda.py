"""The few-row float product's kernel against float64 and against MLX's matmul.

Runs only where MLX has its CUDA backend (``TURBOSPARK_TEST_DEVICE=gpu
python3 -m pytest tests/test_fmv_cuda.py``); elsewhere a float product is
MLX's matmul, ``tests/test_fmv_kernel_path.py`` checks which products
:func:`~turbospark.layers.stacked.matmul_t` and
:func:`~turbospark.layers.stacked.gemm_add` hand the kernel, and
``tests/test_fmv_source.py`` runs its source as C++. Here the kernel's
product is held to float64 and to ``x @ w.T`` (``mx.addmm`` with an
addend) on the same inputs: bfloat16 and float16, 2 to 16 rows, the
families' widths and odd ones, a bias and a residual, x a view that starts
anywhere, inside a compiled function. (A batched engine's routing is
checked on the CPU; greedy tokens of a random bfloat16 model are no test of
it: near-tied logits flip with any change in summation order.)
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark.layers.cuda import fmv as fmv_cuda
from turbospark.layers.stacked import gemm_add, matmul_t

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")

# (outputs, inputs): the large shapes' q/k/v, gate+up and down, the ~8B
# shape's o, outputs not a multiple of a block's 16, one 32-value block.
SHAPES = [(3072, 2048), (16384, 2048), (2048, 8192), (4096, 4096), (1001, 96), (24, 32)]
ROWS = [2, 3, 8, 9, fmv_cuda.R_MAX]


@pytest.fixture(autouse=True)
def _gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU, with the kernel switched on (it is off by default)."""
    mx.set_default_device(mx.gpu)
    monkeypatch.setattr(fmv_cuda, "ENABLED", True)


def _inputs(rows: int, outputs: int, width: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    kx, kw = mx.random.split(mx.random.key(rows * 7 + outputs + width))
    x = mx.random.normal((rows, 1, width), key=kx).astype(dtype)
    w = (mx.random.normal((outputs, width), key=kw) * width**-0.5).astype(dtype)
    mx.eval(x, w)
    return x, w


def _check(
    got: mx.array, x: mx.array, w: mx.array, addend: mx.array | None = None, mlx: bool = True
) -> None:
    """*got* within float32 sums and one rounding of float64, and (*mlx*)
    near MLX's own product: ``addmm`` rounds the product before it adds the
    addend, so that comparison allows a rounding of each."""
    x64 = np.array(x.astype(mx.float32), dtype=np.float64).reshape(-1, x.shape[-1])
    w64 = np.array(w.astype(mx.float32), dtype=np.float64)
    product = x64 @ w64.T
    exact = product
    if addend is not None:
        exact = product + np.array(addend.astype(mx.float32), dtype=np.float64).reshape(
            -1, w.shape[0]
        )
    size = np.abs(x64) @ np.abs(w64).T
    unit = 2.0**-8 if x.dtype == mx.bfloat16 else 2.0**-11
    got64 = np.array(got.astype(mx.float32), dtype=np.float64).reshape(exact.shape)
    bound = 1e-5 * size + unit * np.abs(exact)
    assert np.all(np.abs(got64 - exact) <= bound), np.max(np.abs(got64 - exact) - bound)
    if not mlx:
        return
    theirs = (x @ w.T) if addend is None else mx.addmm(addend, x, w.T)
    theirs64 = np.array(theirs.astype(mx.float32), dtype=np.float64).reshape(exact.shape)
    bound = 1e-5 * size + 2 * unit * (np.abs(exact) + np.abs(product))
    assert np.all(np.abs(got64 - theirs64) <= bound), np.max(np.abs(got64 - theirs64) - bound)


@pytest.mark.parametrize("dtype", fmv_cuda.DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("outputs", "width"), SHAPES)
def test_equals_float64_and_mlx_matmul(
    outputs: int, width: int, rows: int, dtype: mx.Dtype
) -> None:
    x, w = _inputs(rows, outputs, width, dtype)
    assert fmv_cuda.takes(x, w.T)
    _check(fmv_cuda.fmv(x, w.T), x, w)


@pytest.mark.parametrize("dtype", fmv_cuda.DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["bias", "residual"])
def test_adds_a_bias_or_a_residual(kind: str, dtype: mx.Dtype) -> None:
    x, w = _inputs(5, 1001, 2048, dtype)
    shape = (1001,) if kind == "bias" else (5, 1, 1001)
    addend = mx.random.normal(shape, key=mx.random.key(3)).astype(dtype)
    _check(fmv_cuda.fmv(x, w.T, addend), x, w, addend)
    _check(gemm_add(addend, x, w.T), x, w, addend)


def test_a_view_starting_anywhere() -> None:
    """x row-contiguous but one value past a 16-byte boundary (a view into a
    larger buffer): the kernel's value-by-value loads. Against float64 only:
    MLX 0.32's own matmul of such a view fails on CUDA (cuBLASLt: not
    supported, code 15)."""
    _, w = _inputs(4, 40, 2048, mx.bfloat16)
    flat = mx.random.normal((4 * 2048 + 1,), key=mx.random.key(9)).astype(mx.bfloat16)
    x = flat[1:].reshape(4, 1, 2048)
    _check(matmul_t(x, w.T), x, w, mlx=False)


def test_inside_a_compiled_function() -> None:
    x, w = _inputs(6, 3072, 2048, mx.bfloat16)
    weight_t = w.T
    mx.eval(weight_t)
    _check(mx.compile(lambda a: matmul_t(a, weight_t))(x), x, w)
