"""The quantized matrix-vector kernel against float64 and against ``mx.quantized_matmul``.

Runs only where MLX has its CUDA backend (``TURBOSPARK_TEST_DEVICE=gpu
python3 -m pytest tests/test_qmv_cuda.py``); elsewhere a packed product is
``mx.quantized_matmul`` and ``tests/test_qmv_kernel_path.py`` checks which
products :func:`~turbospark.layers.stacked.matmul_t` hands the kernel. Here
the kernel's product is held to the exact product of the dequantized values
(float64, from the packed bits) and to MLX's op on the same packing: 4 and 8
bits, groups of 32, 64 and 128, the ~8B shapes' widths and odd ones, 1 to
:data:`~turbospark.layers.cuda.qmv.R_MAX` rows, float32 and bfloat16; every
variant (:class:`~turbospark.layers.cuda.qmv.Variant`) equal to one output a
warp, bit for bit; views that start anywhere; the kernel inside a compiled
function; and a quantized model's logits with the kernel against the same
model without it.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import dequantize_model

from helpers import chunks_and_steps
from turbospark.generation.runner import Runner
from turbospark.layers.cuda import qmv as qmv_cuda
from turbospark.layers.stacked import Packed, matmul_t

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")

# (outputs, inputs): the ~8B shape's o and down projections (qkv, gate+up and
# the head read the same widths), a row shorter than a warp's pass (lanes
# idle), one ending mid-pass, a single group, and outputs not a multiple of a
# block's warps.
SHAPES = [(4096, 4096), (4096, 14336), (37, 384), (1001, 1408), (5, 128)]
ROWS = [1, 2, 5, qmv_cuda.R_MAX]


@pytest.fixture(autouse=True)
def _gpu() -> None:
    mx.set_default_device(mx.gpu)


def _packed(
    outputs: int, width: int, bits: int, group_size: int, dtype: mx.Dtype, seed: int
) -> tuple[mx.array, mx.array, mx.array]:
    weight = (mx.random.normal((outputs, width), key=mx.random.key(seed)) * 0.05).astype(dtype)
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    mx.eval(w, scales, biases)
    return w, scales, biases


def _terms64(
    w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each packed value's two terms in float64, unpacked from its bits (value
    j of a uint32 in bits ``bits * j`` up): ``scale * q`` and ``bias``."""
    words = np.array(w).astype(np.uint64)
    per_word = 32 // bits
    q = np.stack([(words >> (bits * j)) & ((1 << bits) - 1) for j in range(per_word)], axis=-1)
    q = q.reshape(w.shape[0], -1).astype(np.float64)
    s, b = (
        np.repeat(np.array(a.astype(mx.float32), dtype=np.float64), group_size, axis=1)
        for a in (scales, biases)
    )
    return s * q, b


def _x(rows: int, width: int, dtype: mx.Dtype, seed: int) -> mx.array:
    return mx.random.normal((rows, 1, width), key=mx.random.key(seed + 1)).astype(dtype)


def _check(
    got: mx.array, x: mx.array, packed: tuple[mx.array, ...], group_size: int, bits: int
) -> None:
    """*got* against float64 and against ``mx.quantized_matmul``.

    Against the exact product of the dequantized values: the float32 sums'
    error, bounded by a millionth of the terms' sizes (a float32 emulation of
    the kernel's order of sums stays under 3e-9 of them at K = 14,336), plus
    one rounding to bfloat16 where the activations are. Against MLX's op:
    in float32 as close (1e-5 of the terms' sizes); in bfloat16 it
    dequantizes each weight to bfloat16 and, at 4 bits, keeps its lanes'
    partial sums in bfloat16 (MLX's CUDA ``qmv``), so a bfloat16 ulp of the
    terms' sizes: loose, but a wrong scale, bias or value is far past it."""
    w, scales, biases = packed
    # MLX's op on rows (B, K): a one-dimensional x raised an IndexError on CUDA.
    rows = x.reshape(-1, x.shape[-1])
    op = qmv_cuda.qmv_ops(rows, w, scales, biases, group_size, bits).reshape(got.shape)
    assert got.shape == op.shape and got.dtype == op.dtype == x.dtype
    x64 = np.array(rows.astype(mx.float32), dtype=np.float64)
    scaled, bias = _terms64(w, scales, biases, group_size, bits)
    exact = x64 @ (scaled + bias).T
    size = np.abs(x64) @ (np.abs(scaled) + np.abs(bias)).T
    bf16 = x.dtype == mx.bfloat16
    bound = 1e-6 * size + (2.0**-8 if bf16 else 0.0) * np.abs(exact)
    got64, op64 = (
        np.array(a.astype(mx.float32), dtype=np.float64).reshape(exact.shape) for a in (got, op)
    )
    assert np.all(np.abs(got64 - exact) <= bound), np.max(np.abs(got64 - exact) - bound)
    op_bound = 2 * bound + (2.0**-7 if bf16 else 1e-5) * size
    assert np.all(np.abs(got64 - op64) <= op_bound), np.max(np.abs(got64 - op64) - op_bound)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("group_size", qmv_cuda.GROUP_SIZES)
@pytest.mark.parametrize("bits", qmv_cuda.BITS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_one_row_equals_float64_and_quantized_matmul(
    shape: tuple[int, int], bits: int, group_size: int, dtype: mx.Dtype
) -> None:
    outputs, width = shape
    if width % group_size:
        pytest.skip("the width is not whole groups")
    packed = _packed(outputs, width, bits, group_size, dtype, seed=outputs + bits)
    x = _x(1, width, dtype, seed=width)
    assert qmv_cuda.takes(x, *packed, group_size, bits, "affine")
    _check(qmv_cuda.qmv(x, *packed, group_size, bits), x, packed, group_size, bits)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bits", qmv_cuda.BITS)
@pytest.mark.parametrize("rows", ROWS)
def test_several_rows_equal_float64_and_each_row_alone(rows: int, bits: int, dtype: mx.Dtype) -> None:  # fmt: skip
    """A batched decode step's rows, ``(rows, 1, K)``; each row of the product
    is the product of that row alone, bit for bit (the same sums)."""
    packed = _packed(1001, 1408, bits, 64, dtype, seed=rows)
    x = _x(rows, 1408, dtype, seed=rows)
    got = qmv_cuda.qmv(x, *packed, 64, bits)
    _check(got, x, packed, 64, bits)
    for r in range(rows):
        alone = qmv_cuda.qmv(x[r : r + 1], *packed, 64, bits)
        assert mx.array_equal(got[r : r + 1], alone).item(), f"row {r}"
    flat = qmv_cuda.qmv(x.reshape(1, rows, -1), *packed, 64, bits)  # a short verify pass's shape
    assert mx.array_equal(flat.reshape(got.shape), got).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_views_equal_their_copies(dtype: mx.Dtype) -> None:
    """x a row (one-dimensional) starting one element into a longer array (a
    row-contiguous view, which MLX hands over as it is: its 16-byte loads fall
    back to single values), and a module's rows of a stacked packing (the
    packed rows, scales and biases at an offset): the copies' product, bit for
    bit, in every variant (shared x stages a view's values one at a time)."""
    width, bits, group_size = 4096, 4, 64
    x = mx.random.normal((width + 9,), key=mx.random.key(3)).astype(dtype)[1 : width + 1]
    stack = _packed(3 * 512, width, bits, group_size, dtype, seed=4)
    part = tuple(a[512 + 7 : 1024] for a in stack)
    mx.eval(x, part)
    copies = [a + 0 for a in (x, *part)]  # fresh, aligned arrays
    mx.eval(copies)
    for variant in VARIANTS:
        got = qmv_cuda.qmv(x, *part, group_size, bits, variant)
        want = qmv_cuda.qmv(copies[0], *copies[1:], group_size, bits, variant)
        assert mx.array_equal(got, want).item(), f"variant {variant}"
        _check(got, copies[0], tuple(copies[1:]), group_size, bits)


# Every variant, each case's products held to float64, to the op and, bit for
# bit, to one output a warp (the same sums in the same order): outputs not a
# multiple of any block's, a row shorter than a warp's pass, one group, a row
# ending mid-pass (shared tiles ending mid-row at 3 rows), a row of two
# shared tiles at one row, and 8 rows (a shared tile a pass).
# Each variant is a kernel of its own per case, and the cases multiply, so
# here: every outputs-a-warp and staging at 4 passes, and every pass count at
# the table's four outputs with x staged; tests/test_qmv_source.py holds every
# combination equal bit for bit on the CPU.
VARIANTS = sorted(
    {
        *(qmv_cuda.Variant(o, 4, s) for o, s in itertools.product(qmv_cuda.OUTS, (False, True))),
        *(qmv_cuda.Variant(4, u, True) for u in qmv_cuda.UNROLLS),
    }
)
ONE_OUTPUT = qmv_cuda.Variant(1, 1, False)
VARIANT_CASES = [  # (outputs, inputs, bits, group size, rows, dtype)
    (37, 384, 4, 64, 1, mx.bfloat16),
    (5, 128, 8, 128, 2, mx.float32),
    (1001, 1408, 4, 32, 3, mx.bfloat16),
    (300, 8192, 4, 64, 1, mx.bfloat16),
    (260, 4096, 8, 64, qmv_cuda.R_MAX, mx.bfloat16),
    (1001, 1408, 4, 128, qmv_cuda.R_MAX, mx.float32),
]


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_every_variant_equals_float64_the_op_and_one_output_a_warp(case: tuple) -> None:
    outputs, width, bits, group_size, rows, dtype = case
    packed = _packed(outputs, width, bits, group_size, dtype, seed=outputs + rows)
    x = _x(rows, width, dtype, seed=rows)
    baseline = qmv_cuda.qmv(x, *packed, group_size, bits, ONE_OUTPUT)
    for variant in VARIANTS:
        got = qmv_cuda.qmv(x, *packed, group_size, bits, variant)
        _check(got, x, packed, group_size, bits)
        assert mx.array_equal(got, baseline).item(), f"variant {variant}"


def test_matmul_t_takes_it_compiled_and_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`matmul_t` on a :class:`Packed` on the GPU is the kernel (bit for
    bit), traced by ``mx.compile`` as called; past :data:`R_MAX` rows and with
    its switch off it is MLX's op."""
    packed = _packed(4096, 4096, 4, 64, mx.bfloat16, seed=5)
    weight_t = Packed(*packed, 64, 4, "affine")
    x = _x(qmv_cuda.R_MAX + 1, 4096, mx.bfloat16, seed=5)
    one = x[:1]
    kernel = qmv_cuda.qmv(one, *packed, 64, 4)
    assert mx.array_equal(matmul_t(one, weight_t), kernel).item()
    compiled = mx.compile(lambda a, w, s, b: matmul_t(a, Packed(w, s, b, 64, 4, "affine")))
    assert mx.array_equal(compiled(one, *packed), kernel).item()
    op = qmv_cuda.qmv_ops(x, *packed, 64, 4)
    assert mx.array_equal(matmul_t(x, weight_t), op).item()
    monkeypatch.setattr(qmv_cuda, "ENABLED", False)
    assert not qmv_cuda.available()
    assert mx.array_equal(matmul_t(one, weight_t), qmv_cuda.qmv_ops(one, *packed, 64, 4)).item()


def _quantized(runner: Runner, bits: int) -> Runner:
    """*runner*'s model with every linear layer whose inputs are whole groups
    of 32 quantized (``tests/test_quantized_paths.py``'s choice)."""
    nn.quantize(
        runner.model, group_size=32, bits=bits,
        class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0,
    )  # fmt: skip
    mx.eval(runner.model.parameters())
    return runner


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
@pytest.mark.parametrize("bits", qmv_cuda.BITS)
def test_a_quantized_model_equals_its_dequantized_twin(
    family: str, bits: int, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uneven chunks (MLX's op: more rows than the kernel takes), then decode
    steps (the kernel, inside the layers' traces): every forward's logits as
    the same model's with the quantized values dequantized to float layers
    (float matmuls over the same values; a different trace, so none of the
    quantized model's traces is replayed for it)."""
    path = request.getfixturevalue(f"{family}_install")
    taken = []

    def counted(x: mx.array, *args: object) -> mx.array:
        taken.append(x.shape)
        return kernel(x, *args)

    kernel = qmv_cuda.qmv
    monkeypatch.setattr(qmv_cuda, "qmv", counted)
    prompt = [3 + (7 * i) % 90 for i in range(30)]

    def _open() -> Runner:
        return _quantized(Runner.open(path, context_length=256, dtype="float32"), bits)

    got = chunks_and_steps(_open(), prompt)[0]
    reference = _open()
    dequantize_model(reference.model)
    want = chunks_and_steps(reference, prompt)[0]
    assert taken, "no product took the kernel"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(
            np.array(a), np.array(b), atol=1e-4, rtol=1e-4, err_msg=f"forward {i}"
        )
