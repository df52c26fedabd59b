"""The qmv kernel's source, every variant, run as C++ on the CPU against float64.

The kernel runs only on MLX's CUDA backend (``tests/test_qmv_cuda.py``, on a
GPU), and ``tests/test_cuda_sources.py`` only compiles it; here its
arithmetic is checked wherever a C++ compiler is. The kernel's header and
body (:mod:`turbospark.layers.cuda.qmv`, after the shared reductions'
header) are compiled unchanged under a few shims: each CUDA thread of a
block is a fiber (``ucontext``) that the launcher resumes in turn,
``__syncthreads`` and each warp shuffle yield to the next round (every
thread reaches each of them, which the launcher checks: a thread that ends
while others still wait is an error), ``__shared__`` is a function's static
(blocks run one after another), and bfloat16 is its bits with
round-to-nearest-even. Each variant's product is held to the exact product
of the dequantized values in float64 and, bit for bit, to the one-output
variant's: they add the same terms in the same order. Shapes: outputs not a
multiple of a block's, a row shorter than a warp's pass, a row ending
mid-pass, shared tiles ending mid-row, one group, 1 to
:data:`~turbospark.layers.cuda.qmv.R_MAX` rows, and x starting one element
past a 16-byte boundary. Skipped where no C++ compiler is found.
"""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

from turbospark.layers.cuda import qmv as qmv_cuda
from turbospark.layers.cuda import reduce as reduce_cuda

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler (g++ or clang++)")

# CUDA's names for what the kernel uses, on the CPU.
SHIMS = r"""
#if defined(__APPLE__)
#define _XOPEN_SOURCE 700  // macOS declares the ucontext calls only under it
#endif
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ucontext.h>
#include <vector>
using std::size_t;
#define __device__
#define __global__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct uint4 { uint32_t x, y, z, w; };
struct float4 { float x, y, z, w; };
struct dim3 { unsigned x = 0, y = 0, z = 0; };
static dim3 threadIdx, blockIdx;
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
struct bf16 {
    uint16_t bits;
    bf16() = default;
    explicit bf16(float f) {
        uint32_t u; std::memcpy(&u, &f, 4);
        bits = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // nearest, ties even
    }
    operator float() const { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
};

// The launcher: a block's threads as fibers, resumed in rounds.
constexpr int MAX_THREADS = 256;  // a block's threads at most (qmv launches 128)
static ucontext_t scheduler, fibers[MAX_THREADS];
static bool finished[MAX_THREADS];
static int current, block_threads;
static float shuffled[2][MAX_THREADS];
static int shuffles[MAX_THREADS];
static void (*body)();
static void yield() { swapcontext(&fibers[current], &scheduler); }
inline void __syncthreads() { yield(); }
// Double-buffered: a slot written in one round is read in the next, before
// any thread can write that buffer again (two rounds on).
inline float __shfl_xor_sync(unsigned, float value, int offset) {
    const int me = current, parity = shuffles[me]++ & 1;
    shuffled[parity][me] = value;
    yield();
    return shuffled[parity][(me & ~31) | ((me & 31) ^ offset)];
}
static void trampoline() { body(); finished[current] = true; }
// Runs `grid` blocks of `threads`; false where a thread ended before another
// reached a barrier (the kernel would deadlock or read stale lanes on a GPU).
static bool launch(void (*kernel)(), int grid, int threads) {
    static std::vector<char> stacks(static_cast<size_t>(MAX_THREADS) * 65536);
    body = kernel;
    block_threads = threads;
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = b;
        for (int t = 0; t < threads; ++t) {
            getcontext(&fibers[t]);
            fibers[t].uc_stack.ss_sp = stacks.data() + static_cast<size_t>(t) * 65536;
            fibers[t].uc_stack.ss_size = 65536;
            fibers[t].uc_link = &scheduler;
            makecontext(&fibers[t], trampoline, 0);
            finished[t] = false;
            shuffles[t] = 0;
        }
        for (int done = 0; done < threads;) {
            for (int t = 0; t < threads; ++t) {
                current = t;
                threadIdx.x = t;
                swapcontext(&scheduler, &fibers[t]);
            }
            done = 0;
            for (int t = 0; t < threads; ++t) done += finished[t];
            if (done != 0 && done != threads) return false;
        }
    }
    return true;
}
"""

C_TYPES = {"float32": "float", "bfloat16": "bf16"}


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
    assert qmv_cuda.WARPS * 32 <= 256, "raise the launcher's MAX_THREADS"
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
    folder = tmp_path_factory.mktemp("qmv_source")
    source, built = folder / "qmv.cpp", folder / "qmv.so"
    source.write_text(_translation_unit())
    done = subprocess.run(
        [CXX, "-std=c++17", "-O0", "-ffp-contract=off", "-Wno-unknown-pragmas",
         "-Wno-deprecated-declarations", "-shared",
         "-fPIC", "-o", str(built), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return ctypes.CDLL(str(built))


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """Float32 values cut to bfloat16 (their top 16 bits), as those bits."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _floats(bits_or_values: np.ndarray) -> np.ndarray:
    if bits_or_values.dtype == np.uint16:
        return (bits_or_values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits_or_values.astype(np.float64)


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
        scales, biases, x = (_bf16_bits(a) for a in (scales, biases, x))
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
    scaled = np.repeat(_floats(scales), case.group_size, axis=1) * q
    bias = np.repeat(_floats(biases), case.group_size, axis=1)
    x64 = _floats(x)[case.offset : case.offset + case.rows * case.width].reshape(case.rows, -1)
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
        got64 = _floats(got)
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
