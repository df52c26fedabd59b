"""Which float products the few-row kernel takes, on the CPU.

On MLX's CUDA backend a product of 2 to :data:`~turbospark.layers.cuda.fmv.R_MAX`
rows by a bfloat16 or float16 weight (:func:`~turbospark.layers.stacked.matmul_t`,
and :func:`~turbospark.layers.stacked.gemm_add` with its bias or residual)
is the kernel (:func:`~turbospark.layers.cuda.fmv.fmv`); a lone row keeps
MLX's gemv, more rows cuBLAS. The kernel runs only on a GPU
(``tests/test_fmv_cuda.py``); here it is replaced by a recorder over its
contract in ops (:func:`~turbospark.layers.cuda.fmv.fmv_ops`), so the
routing is checked wherever the suite runs: each shape and dtype taken or
not, the addends handed to it, and an engine's batched decode (rows joining
and leaving) token for token against the same engine without it. The
engine runs float32, as the suite's models do, with float32 admitted to the
kernel's dtypes for the recorder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import engine_arrivals
from turbospark.generation.runner import Runner
from turbospark.layers.cuda import fmv as fmv_cuda
from turbospark.layers.stacked import Packed, gemm_add, matmul_t

WIDTH, OUTPUTS = 64, 40
Taken = list[tuple[tuple[int, ...], tuple[int, ...] | None]]


def taken_by(monkeypatch: pytest.MonkeyPatch) -> Taken:
    """The shapes of x (and of the addend) the kernel is handed from now on,
    its contract computing them, with the kernel available as on CUDA."""
    shapes: Taken = []

    def recorder(x: mx.array, weight_t: mx.array, addend: mx.array | None = None) -> mx.array:
        shapes.append((x.shape, None if addend is None else addend.shape))
        return fmv_cuda.fmv_ops(x, weight_t, addend)

    monkeypatch.setattr(fmv_cuda, "ENABLED", True)
    monkeypatch.setattr(fmv_cuda, "available", lambda: True)
    monkeypatch.setattr(fmv_cuda, "fmv", recorder)
    return shapes


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> Taken:
    return taken_by(monkeypatch)


def _weight_t(dtype: mx.Dtype = mx.bfloat16, width: int = WIDTH) -> mx.array:
    weight = mx.random.normal((OUTPUTS, width), key=mx.random.key(width)).astype(dtype)
    return weight.T


def _x(*lead: int, dtype: mx.Dtype = mx.bfloat16, width: int = WIDTH) -> mx.array:
    return mx.random.normal((*lead, width), key=mx.random.key(len(lead))).astype(dtype)


@pytest.mark.parametrize("dtype", fmv_cuda.DTYPES, ids=str)
@pytest.mark.parametrize("lead", [(2, 1), (fmv_cuda.R_MAX, 1), (3,), (2, 2, 2), (4, 1, 1)])
def test_few_rows_of_a_half_precision_weight_take_the_kernel(
    lead: tuple[int, ...], dtype: mx.Dtype, taken: Taken
) -> None:
    x, weight_t = _x(*lead, dtype=dtype), _weight_t(dtype)
    got = matmul_t(x, weight_t)
    assert taken == [(x.shape, None)]
    assert got.shape == (*lead, OUTPUTS)
    assert mx.array_equal(got, x @ weight_t).item()


@pytest.mark.parametrize(
    ("x", "weight_t", "why"),
    [
        (_x(1, 1), _weight_t(), "one row: MLX's gemv"),
        (_x(1), _weight_t(), "one row, flat"),
        (_x(fmv_cuda.R_MAX + 1, 1), _weight_t(), "more rows than an MMA's"),
        (_x(4, 1, dtype=mx.float32), _weight_t(mx.float32), "float32: no MMA of it"),
        (_x(4, 1, width=48), _weight_t(width=48), "a width not of 32-value blocks"),
        (_x(4, 1), _weight_t(mx.float16), "the weight's dtype is not x's"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_other_products_keep_mlx_matmul(
    x: mx.array, weight_t: mx.array, why: str, taken: Taken
) -> None:
    got = matmul_t(x, weight_t)
    assert taken == [], why
    assert mx.array_equal(got, x @ weight_t).item()


def test_packed_weights_are_not_its(taken: Taken) -> None:
    w, scales, biases = mx.quantize(mx.random.normal((OUTPUTS, WIDTH)), group_size=32, bits=4)
    matmul_t(_x(4, 1, dtype=mx.float32), Packed(w, scales, biases, 32, 4, "affine"))
    assert taken == []


def test_unavailable_never_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default (TURBOSPARK_FMV_KERNEL=1 takes it), and on the CPU
    nothing takes it even switched on."""
    monkeypatch.setattr(fmv_cuda, "fmv", lambda *a: pytest.fail("took the kernel"))
    assert not fmv_cuda.ENABLED and not fmv_cuda.available()
    x, weight_t = _x(4, 1), _weight_t()
    assert mx.array_equal(matmul_t(x, weight_t), x @ weight_t).item()
    monkeypatch.setattr(fmv_cuda, "ENABLED", True)
    assert not fmv_cuda.available()
    assert mx.array_equal(matmul_t(x, weight_t), x @ weight_t).item()


@pytest.mark.parametrize("text", ["0", "17", "two", "", "-1"])
def test_a_bad_min_rows_is_a_one_line_error(text: str) -> None:
    with pytest.raises(ValueError, match="give a number of rows from 1 to 16") as raised:
        fmv_cuda.min_rows(text)
    assert "\n" not in str(raised.value)
    assert fmv_cuda.min_rows(" 1") == 1


def test_the_min_rows_knob_is_read_at_import() -> None:
    """``TURBOSPARK_FMV_MIN_ROWS=1`` hands a lone row's product to the kernel
    too, in a fresh process; a bad value stops the import with the one-line error."""
    code = "from turbospark.layers.cuda import fmv; print(fmv.R_MIN)"
    env = {**os.environ, "TURBOSPARK_FMV_MIN_ROWS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "1", done.stderr[-2000:]
    env["TURBOSPARK_FMV_MIN_ROWS"] = "0"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: TURBOSPARK_FMV_MIN_ROWS='0'")


@pytest.mark.parametrize(("arch", "has"), [("sm_70", False), ("sm_75", False), ("sm_80", True), ("sm_90", True), ("sm_120", True)])  # fmt: skip
def test_only_gpus_with_bfloat16_mma_take_it(
    arch: str, has: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fmv_cuda.nvrtc, "architecture", lambda: arch)
    fmv_cuda.has_mma.cache_clear()
    try:
        assert fmv_cuda.has_mma() is has
    finally:
        fmv_cuda.has_mma.cache_clear()


@pytest.mark.parametrize(
    ("addend_shape", "handed"),
    [((OUTPUTS,), True), ((4, 1, OUTPUTS), True), ((1, OUTPUTS), False), ((4, 1, 1), False)],
    ids=["bias", "residual", "broadcast-row", "broadcast-column"],
)
def test_gemm_add_hands_it_a_bias_or_a_residual(
    addend_shape: tuple[int, ...], handed: bool, taken: Taken
) -> None:
    """A bias or a residual shaped as the product is the kernel's own add;
    an addend that broadcasts otherwise is added after the kernel's product."""
    x, weight_t = _x(4, 1), _weight_t()
    addend = mx.random.normal(addend_shape, key=mx.random.key(7)).astype(mx.bfloat16)
    got = gemm_add(addend, x, weight_t)
    want = mx.addmm(addend, x, weight_t)
    assert taken == ([(x.shape, addend_shape)] if handed else [(x.shape, None)])
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=1e-2, atol=1e-2
    )


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_a_batched_engine_decodes_as_without_it(
    family: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows join a running batch and leave it, greedy: token for token the
    same with the kernel's routing as without, and its batched steps handed
    the kernel their products, one row a live session."""
    path: Path = request.getfixturevalue(f"{family}_install")
    prompts = [[3 + (7 * i + r) % 90 for i in range(n)] for r, n in enumerate([7, 3, 12, 5])]
    arrivals, lengths = [0, 0, 2, 4], [9, 5, 8, 6]
    runs, rows_handed = [], []
    for routed in (False, True):
        shapes: Taken = []
        if routed:
            monkeypatch.setattr(fmv_cuda, "DTYPES", (*fmv_cuda.DTYPES, mx.float32))
            shapes = taken_by(monkeypatch)
        runner = Runner.open(path, context_length=256, dtype="float32", session_slots=4)
        runs.append(engine_arrivals(runner, path, prompts, arrivals, lengths))
        rows_handed.append({int(np.prod(shape[:-1])) for shape, _ in shapes})
    assert runs[1] == runs[0]
    assert [len(tokens) for tokens in runs[0]] == lengths
    assert rows_handed[0] == set()
    assert {2, 3} <= rows_handed[1] <= set(range(fmv_cuda.R_MIN, fmv_cuda.R_MAX + 1))
