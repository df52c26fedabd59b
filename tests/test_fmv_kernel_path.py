"""Which float products :func:`~turbospark.layers.stacked.matmul_t` hands the fmv kernel, on the CPU.

On MLX's CUDA backend, with ``TURBOSPARK_FMV_KERNEL=1``, a float product of
:data:`~turbospark.layers.cuda.fmv.R_MIN` to
:data:`~turbospark.layers.cuda.fmv.R_MAX` rows is the kernel
(:func:`~turbospark.layers.cuda.fmv.fmv`); one row keeps MLX's gemv and more
rows keep its matmul. The kernel runs only on a GPU
(``tests/test_fmv_cuda.py``); here it is replaced by a recorder over its
contract in ops (:func:`~turbospark.layers.cuda.fmv.fmv_ops`), so the routing
is checked wherever the suite runs: each product taken or not, the result
the op's either way (a bias or residual added after it), and each family's
batched decode steps (every product the kernel's) equal to the same steps
without it. Float32 on CPU.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import batched_greedy, recorded_kernel
from turbospark.generation.runner import Runner
from turbospark.layers.cuda import fmv as fmv_cuda
from turbospark.layers.stacked import Packed, gemm_add, matmul_t

WIDTH = 96


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of x the kernel was handed (its contract computing them),
    with the kernel available as on CUDA."""
    return recorded_kernel(monkeypatch, fmv_cuda, "fmv", fmv_cuda.fmv_ops)


def _weight_t(dtype: mx.Dtype = mx.float32, outputs: int = 40) -> mx.array:
    weight = mx.random.normal((outputs, WIDTH), key=mx.random.key(outputs)).astype(dtype)
    return weight.T


def _x(*lead: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    return mx.random.normal((*lead, WIDTH), key=mx.random.key(len(lead))).astype(dtype)


@pytest.mark.parametrize("lead", [(2, 1), (5, 1), (fmv_cuda.R_MAX, 1), (1, 7), (3,)])
def test_a_few_rows_take_the_kernel(lead: tuple[int, ...], taken: list) -> None:
    """A batched step's ``(B, 1, K)``, a short chunk's ``(1, L, K)``, rows in two
    dimensions: the kernel's product, equal to MLX's, with a residual added after it."""
    x, weight_t = _x(*lead), _weight_t()
    got = matmul_t(x, weight_t)
    assert taken == [x.shape]
    np.testing.assert_allclose(np.array(got), np.array(x @ weight_t), rtol=1e-6)
    residual = mx.ones(got.shape)
    added = gemm_add(residual, x, weight_t)
    assert taken == [x.shape, x.shape]
    np.testing.assert_allclose(np.array(added), np.array(residual + x @ weight_t), rtol=1e-6)


def test_other_products_keep_mlx_matmul(taken: list) -> None:
    """One row (MLX's gemv), more rows than R_MAX, a weight of another dtype,
    and a packed weight (the qmv kernel's or MLX's) never take it."""
    for x, weight_t in [
        (_x(1, 1), _weight_t()),
        (_x(fmv_cuda.R_MAX + 1, 1), _weight_t()),
        (_x(2, 1), _weight_t(mx.bfloat16)),
    ]:
        np.testing.assert_array_equal(np.array(matmul_t(x, weight_t)), np.array(x @ weight_t))
    w, scales, biases = mx.quantize(mx.random.normal((40, WIDTH)), group_size=32, bits=4)
    matmul_t(_x(2, 1), Packed(w, scales, biases, 32, 4, "affine"))
    assert taken == []


def test_unavailable_never_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (no CUDA backend) the kernel is never called."""
    monkeypatch.setattr(fmv_cuda, "fmv", lambda *_: pytest.fail("the kernel was called"))
    assert not fmv_cuda.available()
    matmul_t(_x(4, 1), _weight_t())


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_batched_decode_steps_take_it_and_equal_the_plain_path(
    family: str, request: pytest.FixtureRequest
) -> None:
    """Three rows of ragged prompts merged, then batched greedy steps: with the
    kernel's path every step's products of those rows are the kernel's, and
    the logits are the plain path's."""
    path: Path = request.getfixturevalue(f"{family}_install")
    prompts = [[3 + (7 * i + r) % 90 for i in range(n)] for r, n in enumerate((9, 20, 14))]

    def steps() -> list[mx.array]:
        runner = Runner.open(path, context_length=256, session_slots=4, dtype="float32")
        return batched_greedy(runner, prompts, 4)

    want = steps()
    taken = request.getfixturevalue("taken")
    got = steps()
    assert any(shape[:-1] == (3, 1) for shape in taken)
    assert all(1 < np.prod(shape[:-1]) <= fmv_cuda.R_MAX for shape in taken)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5, err_msg=f"{i}")
