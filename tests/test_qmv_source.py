"""The qmv kernel's source, every variant, run as C++ on the CPU against float64.

The kernel runs only on MLX's CUDA backend (``tests/test_qmv_cuda.py``, on a
GPU), and ``tests/test_cuda_sources.py`` only compiles it; here its
arithmetic is checked wherever a C++ compiler is, its header and body run
unchanged as C++ (``tests/cuda_on_cpu.py``). Each variant's product is held
to the exact product of the dequantized values in float64 and, bit for bit,
to the one-output variant's: they add the same terms in the same order. Shapes: outputs not a
multiple of a block's, a row shorter than a warp's pass, a row ending
mid-pass, shared tiles ending mid-row, one group, 1 to
:data:`~turbospark.layers.cuda.qmv.R_MAX` rows, and x starting one element
past a 16-byte boundary. Skipped where no C++ compiler is found.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

from cuda_on_cpu import C_TYPES, CXX, SHIMS, bf16_bits, build, floats
from turbospark.layers.cuda import qmv as qmv_cuda
from turbospark.layers.cuda import reduce as reduce_cuda

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++ or clang++)")


class Case(NamedTuple):
    outputs: int
    width: int
    bits: int
    group_size: int
    rows: int
    dtype: str
    offset: int  # elements x starts past a 16-byte boundary


# Outputs not a multiple of any block's (37, 70, 5, 33); 12 chunks a row at 4
# bits (lanes idle), one group at 8 bits, 72 chunks (a pass and a bit; shared
# tiles of two passes at 3 rows, the last one short), 8 rows at 8 bits (a
# shared tile a pass), x at an odd offset.
CASES = [
    Case(37, 384, 4, 64, 1, "float32", 0),
    Case(5, 128, 8, 128, 2, "bfloat16", 0),
    Case(70, 2304, 4, 32, 3, "bfloat16", 1),
    Case(33, 1024, 8, 64, qmv_cuda.R_MAX, "float32", 1),
    Case(9, 1024, 4, 128, qmv_cuda.R_MAX, "bfloat16", 0),
]
VARIANTS = [
    qmv_cuda.Variant(outs, unroll, shared)
    for outs, unroll, shared in itertools.product(qmv_cuda.OUTS, qmv_cuda.UNROLLS, (False, True))
]


def _template(case: Case, variant: qmv_cuda.Variant) -> str:
    return ", ".join(
        str(v)
        for v in (
            case.width, case.group_size, case.bits, case.rows, qmv_cuda.WARPS,
            variant.outs, variant.unroll, int(variant.shared_x), qmv_cuda.SHARED_FLOATS,
            C_TYPES[case.dtype],
        )
    )  # fmt: skip


def _translation_unit() -> str:
    """The shims, the kernel's headers, its body as a template function over
    globals (the launcher's fibers take no arguments), and one entry a (case,
    variant)."""
    parts = [SHIMS, reduce_cuda.HEADER, qmv_cuda._HEADER]
    parts.append(
        "template <typename T> struct Args { static const T *x, *scales, *biases; static T* y; };\n"
        "template <typename T> const T* Args<T>::x;\n"
        "template <typename T> const T* Args<T>::scales;\n"
        "template <typename T> const T* Args<T>::biases;\n"
        "template <typename T> T* Args<T>::y;\n"
        "static const uint32_t* w;\n"
        "static int32_t w_shape[2];\n"
        "template <int K, int GS, int BITS, int ROWS, int WARPS, int OUTS, int UNROLL,\n"
        "          int SHARED_X, int SHARED_FLOATS, typename T>\n"
        "void qmv_kernel() {\n"
        "    const T* x = Args<T>::x; const T* scales = Args<T>::scales;\n"
        "    const T* biases = Args<T>::biases; T* y = Args<T>::y;\n"
        f"{qmv_cuda._SOURCE}\n}}\n"
    )
    for i, (case, variant) in enumerate(itertools.product(CASES, VARIANTS)):
        t = C_TYPES[case.dtype]
        blocks = -(-case.outputs // (qmv_cuda.WARPS * variant.outs))
        parts.append(
            f'extern "C" int run_{i}(const void* x, const uint32_t* w_, const void* s,'
            f" const void* b, void* y, int n) {{\n"
            f"    Args<{t}>::x = static_cast<const {t}*>(x); w = w_; w_shape[0] = n;\n"
            f"    Args<{t}>::scales = static_cast<const {t}*>(s);"
            f" Args<{t}>::biases = static_cast<const {t}*>(b);\n"
            f"    Args<{t}>::y = static_cast<{t}*>(y);\n"
            f"    return launch(qmv_kernel<{_template(case, variant)}>, {blocks},"
            f" {qmv_cuda.WARPS * 32});\n}}\n"
        )
    return "\n".join(parts)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build(_translation_unit(), tmp_path_factory.mktemp("qmv_source"), "qmv")


def _inputs(case: Case) -> tuple[np.ndarray, ...]:
    """Random packed bits, scales and biases, and x (bfloat16-exact where the
    case is bfloat16), x inside a buffer at the case's offset."""
    rng = np.random.default_rng(case.outputs * case.width + case.rows)
    w = rng.integers(0, 2**32, (case.outputs, case.width * case.bits // 32), dtype=np.uint64)
    groups = (case.outputs, case.width // case.group_size)
    scales = rng.normal(size=groups).astype(np.float32) * 0.01
    biases = rng.normal(size=groups).astype(np.float32) * 0.05
    x = rng.normal(size=(case.rows * case.width + 8,)).astype(np.float32)
    if case.dtype == "bfloat16":
        scales, biases, x = (bf16_bits(a) for a in (scales, biases, x))
    return w.astype(np.uint32), scales, biases, x


def _float64(case: Case, w: np.ndarray, scales: np.ndarray, biases: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The exact product of x and the dequantized values, and the sum of its
    terms' sizes (what float32 sums' error scales with)."""
    per_word = 32 // case.bits
    q = np.stack(
        [
            (w.astype(np.uint64) >> (case.bits * j)) & ((1 << case.bits) - 1)
            for j in range(per_word)
        ],
        axis=-1,
    ).reshape(case.outputs, case.width)
    scaled = np.repeat(floats(scales), case.group_size, axis=1) * q
    bias = np.repeat(floats(biases), case.group_size, axis=1)
    x64 = floats(x)[case.offset : case.offset + case.rows * case.width].reshape(case.rows, -1)
    return x64 @ (scaled + bias).T, np.abs(x64) @ (np.abs(scaled) + np.abs(bias)).T


def _run(library: ctypes.CDLL, index: int, case: Case, inputs: tuple[np.ndarray, ...]) -> np.ndarray:  # fmt: skip
    w, scales, biases, x = (np.ascontiguousarray(a) for a in inputs)
    y = np.full((case.rows, case.outputs), 0xFFFF, dtype=x.dtype)  # written where the kernel writes
    start = x.ctypes.data + case.offset * x.itemsize
    ok = getattr(library, f"run_{index}")(
        ctypes.c_void_p(start), ctypes.c_void_p(w.ctypes.data), ctypes.c_void_p(scales.ctypes.data),
        ctypes.c_void_p(biases.ctypes.data), ctypes.c_void_p(y.ctypes.data), case.outputs,
    )  # fmt: skip
    assert ok, "a thread ended while others waited at a barrier or shuffle"
    return y


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.outputs}x{c.width}-{c.bits}b-g{c.group_size}-r{c.rows}-{c.dtype}-o{c.offset}")  # fmt: skip
def test_every_variant_equals_float64_and_one_output_a_warp(
    library: ctypes.CDLL, case: Case
) -> None:
    inputs = _inputs(case)
    exact, size = _float64(case, *inputs)
    bf16 = case.dtype == "bfloat16"
    bound = 1e-6 * size + (2.0**-8 if bf16 else 0.0) * np.abs(exact)
    first = CASES.index(case) * len(VARIANTS)
    results = {v: _run(library, first + i, case, inputs) for i, v in enumerate(VARIANTS)}
    baseline = results[qmv_cuda.Variant(1, 1, False)]
    for variant, got in results.items():
        got64 = floats(got)
        assert np.all(np.abs(got64 - exact) <= bound), (variant, np.max(np.abs(got64 - exact) - bound))  # fmt: skip
        assert np.array_equal(got, baseline), f"variant {variant} differs from one output a warp"


def test_float32_equals_mlx_quantized_matmul(library: ctypes.CDLL) -> None:
    """The contract itself (:func:`~turbospark.layers.cuda.qmv.qmv_ops`, on the
    CPU) on a float32 case's packing: the same product up to float32 sums."""
    case = CASES[3]
    w, scales, biases, x = _inputs(case)
    y = _run(library, CASES.index(case) * len(VARIANTS), case, (w, scales, biases, x))
    rows = mx.array(x[case.offset : case.offset + case.rows * case.width].reshape(case.rows, -1))
    op = qmv_cuda.qmv_ops(rows, mx.array(w), mx.array(scales), mx.array(biases), case.group_size, case.bits)  # fmt: skip
    _, size = _float64(case, w, scales, biases, x)
    assert np.all(np.abs(y.astype(np.float64) - np.array(op, dtype=np.float64)) <= 2e-6 * size)
