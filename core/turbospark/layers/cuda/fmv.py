"""A few rows times a float (bfloat16 or float16) weight as one CUDA kernel, on tensor cores.

A server's batched decode step multiplies 2 to 16 rows by every weight of
the model. MLX 0.32's CUDA backend sends a product of more than one row to
cuBLASLt, and encodes each such call by building its descriptors and asking
cuBLASLt's heuristic for an algorithm anew: about 20 µs of host time a call
(``bench/encode_cost.py``, docs/CUDA.md), against about 3 for one of our
kernels, in a step that is bound by the host. A lone row's product is MLX's
own gemv (one kernel node) and stays so. Off unless
``TURBOSPARK_FMV_KERNEL=1``: measured on an H100 it saved that encoding but
lost more to its calls' Python and its device time (:data:`ENABLED`).

Here a warp computes :data:`TILES` tiles of 8 outputs for up to 16 rows with
``mma.sync`` (m16n8k16, float32 accumulators): the rows are the MMA's 16
rows (zeros past the last), the weight's rows its 8 columns. Lane ``(g, t)``
(``g = lane / 4``, ``t = lane % 4``) loads 16 bytes of a 32-value block of x
(rows ``g`` and ``g + 8``) and of each tile's weight row ``g``, at values
``8t .. 8t + 7``. The MMA's fragments expect other values there (lane
``(g, t)`` holds k = 2t, 2t + 1, 2t + 8, 2t + 9 of a 16-wide step), but a dot
product may sum its terms in any order: the block's 32 values are fed as
two MMA steps over a permutation of k that x and the weight share, so each
lane's two 16-byte loads are its fragments as they are, no shuffle or
shared memory between load and MMA. A block's :data:`SPLIT` warps split
the weight's width (interleaved blocks of 32, so a block's loads are
adjacent) and their partial sums meet in shared memory; the result rounds
once to the activations' dtype, after an optional addend (a bias or a
residual, as ``mx.addmm`` adds its C operand).

The contract is :func:`fmv_ops`, ``x @ w.T`` (``+ addend``), which the
kernel equals up to the order of its float32 sums (``tests/test_fmv_cuda.py``,
on a GPU). ``tests/test_fmv_source.py`` runs the kernel's body as C++ on the
CPU with the MMA computed from its fragments as PTX defines them; the tests
of the routing (``tests/test_fmv_kernel_path.py``) run the contract in its
place. :func:`~turbospark.layers.stacked.matmul_t` and
:func:`~turbospark.layers.stacked.gemm_add` are the callers.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from turbospark.layers import fused
from turbospark.layers.cuda import nvrtc
from turbospark.layers.cuda.kernel import Kernel

# TURBOSPARK_FMV_KERNEL=1 takes the kernel (read once at import). Off by
# default: on an H100 the 16-row gemma4 step spent 0.6 ms less in MLX's
# evaluation with it, but 0.4 ms more building the graph (each eager call's
# Python) and its products ran slower on the device than cuBLAS's, so the
# step took 4.94 ms against 4.33 (docs/CUDA.md).
ENABLED = os.environ.get("TURBOSPARK_FMV_KERNEL", "0") == "1"
R_MAX = 16  # rows a product may have to take it: an MMA's
# The fewest rows (TURBOSPARK_FMV_MIN_ROWS, read once at import): 2, so a
# lone row's product stays MLX's gemv (one kernel node, no cuBLASLt); 1 is
# the A/B of the kernel for a lone row too.


def min_rows(text: str) -> int:
    """``TURBOSPARK_FMV_MIN_ROWS``'s value as rows, or a one-line error naming the range."""
    if not text.strip().isdigit() or not 1 <= int(text) <= R_MAX:
        raise ValueError(
            f"TURBOSPARK_FMV_MIN_ROWS={text!r}: give a number of rows from 1 to {R_MAX} (default 2)"
        )
    return int(text)


R_MIN = min_rows(os.environ.get("TURBOSPARK_FMV_MIN_ROWS", "2"))
DTYPES = (mx.bfloat16, mx.float16)  # the MMA's inputs
TILES = 2  # tiles of 8 outputs a warp (16 outputs a block), unless a caller gives its own
# Warps a product aims for (about 8 an H100 SM), its blocks splitting the width to get there.
WARPS_WANTED = 1024
MAX_SPLIT = 16  # warps a block at most

# The MMA, one per input dtype: D = A B + C over a 16 x 16 x 8 step, float32
# C and D. The fragments are PTX's (``mma.sync.aligned.m16n8k16``): a lane's
# four A registers hold rows (g, g + 8, g, g + 8) at k (2t, 2t, 2t + 8,
# 2t + 8) and the next k, its two B registers k (2t, 2t + 8) and the next at
# column g, its four floats of C and D rows (g, g, g + 8, g + 8) at columns
# 2t, 2t + 1. The pointer argument picks the dtype; it is not read.
_MMA = """
__device__ inline void mma(const CTYPE*, float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.PTX.PTX.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""
MMA_HEADER = "".join(
    _MMA.replace("CTYPE", ctype).replace("PTX", ptx)
    for ctype, ptx in (("__nv_bfloat16", "bf16"), ("__half", "f16"))
)

# 16 bytes (8 values) at p as a uint4: one load where p is 16-byte aligned (a
# view may start anywhere), else value by value; zeros where there is no row.
_LOAD_HEADER = """
template <typename T>
__device__ inline uint4 load8(const T* p, bool present) {
    if (!present) return uint4{0u, 0u, 0u, 0u};
    if ((reinterpret_cast<size_t>(p) & 15) == 0) return *reinterpret_cast<const uint4*>(p);
    uint16_t bits[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) bits[i] = reinterpret_cast<const uint16_t*>(p)[i];
    return uint4{bits[0] | (uint32_t(bits[1]) << 16), bits[2] | (uint32_t(bits[3]) << 16),
                 bits[4] | (uint32_t(bits[5]) << 16), bits[6] | (uint32_t(bits[7]) << 16)};
}
"""

# Inputs: x (rows, K) of T, rows = x_shape[0] <= 16; w (N, K) of T; with an
# addend (ADDEND, :data:`_ADDENDS`), addend: (N,) (a bias) or (rows, N) (a residual) of T. Output y
# (rows, N) of T. Block b computes outputs b * 8 * TILES ...; warp `warp`
# takes the width's 32-value blocks warp, warp + SPLIT, ... A block's 32
# values are two MMA steps: words x, y of each lane's loads (values 8t ..
# 8t + 3) the first, z, w (8t + 4 .. 8t + 7) the second. No thread returns
# early: each reaches the barrier (a past-the-end output reads the last row
# again and is not written).
_SOURCE = """
    constexpr int BLOCKS = K / 32;
    const int rows = x_shape[0];
    const int n_out = w_shape[0];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * 8 * TILES;
    const bool low = g < rows, high = g + 8 < rows;
    const T* x_low = x + static_cast<size_t>(low ? g : 0) * K + 8 * t;
    const T* x_high = x + static_cast<size_t>(high ? g + 8 : 0) * K + 8 * t;
    const T* w_rows[TILES];
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
        const int n = n0 + 8 * i + g;
        w_rows[i] = w + static_cast<size_t>(n < n_out ? n : n_out - 1) * K + 8 * t;
    }
    float acc[TILES][4];
#pragma unroll
    for (int i = 0; i < TILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll 4
    for (int block = warp; block < BLOCKS; block += SPLIT) {
        const int k = block * 32;
        const uint4 a_low = load8(x_low + k, low), a_high = load8(x_high + k, high);
        uint4 b[TILES];
#pragma unroll
        for (int i = 0; i < TILES; ++i) b[i] = load8(w_rows[i] + k, true);
        const uint32_t first[4] = {a_low.x, a_high.x, a_low.y, a_high.y};
        const uint32_t second[4] = {a_low.z, a_high.z, a_low.w, a_high.w};
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
            mma(x, acc[i], first, b[i].x, b[i].y);
            mma(x, acc[i], second, b[i].z, b[i].w);
        }
    }
    __shared__ float partial[SPLIT > 1 ? SPLIT - 1 : 1][TILES][4][32];
    if (SPLIT > 1 && warp > 0) {
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) partial[warp - 1][i][e][lane] = acc[i][e];
        }
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float sum = acc[i][e];
                for (int s = 0; s < SPLIT - 1; ++s) sum += partial[s][i][e][lane];
                const int row = g + 8 * (e / 2), n = n0 + 8 * i + 2 * t + e % 2;
                if (row < rows && n < n_out) {
                    const size_t at = static_cast<size_t>(row) * n_out + n;
                    ADDEND
                    y[at] = static_cast<T>(sum);
                }
            }
        }
    }
"""


# What each addend adds to an output's sum: none, a bias's column, a residual's element.
_ADDENDS = ("", "sum += static_cast<float>(addend[n]);", "sum += static_cast<float>(addend[at]);")


@functools.cache
def _kernel(add: int) -> Kernel:
    """The kernel with no addend (0), a bias (1) or a residual (2)."""
    return Kernel(
        name=f"turbospark_fmv_add{add}",
        input_names=["x", "w", *(["addend"] if add else [])],
        output_names=["y"],
        source=_SOURCE.replace("ADDEND", _ADDENDS[add]),
        header=MMA_HEADER + _LOAD_HEADER,
    )


def available() -> bool:
    """True where the products take this kernel
    (:func:`~turbospark.layers.fused.takes_cuda_kernels`) and the GPU has
    its MMA (:func:`has_mma`)."""
    return fused.takes_cuda_kernels(ENABLED) and has_mma()


@functools.cache
def has_mma() -> bool:
    """Whether device 0 runs bfloat16 ``mma.sync`` (compute capability 8.0
    and later: Ampere, Hopper, Blackwell); an older GPU keeps MLX's matmul."""
    return int(nvrtc.architecture().removeprefix("sm_")) >= 80


def fits(x: mx.array, weight_t: mx.array) -> bool:
    """Whether the kernel computes ``x @ weight_t``: x ``(..., K)`` of
    :data:`R_MIN` to :data:`R_MAX` rows, *weight_t* ``(K, N)`` of x's dtype
    (bfloat16 or float16), K a multiple of 32."""
    if x.ndim == 0 or weight_t.ndim != 2:
        return False
    width = x.shape[-1]
    return (
        width > 0
        and width % 32 == 0
        and R_MIN <= x.size // width <= R_MAX
        and weight_t.shape[0] == width
        and x.dtype in DTYPES
        and weight_t.dtype == x.dtype
    )


def takes(x: mx.array, weight_t: mx.array) -> bool:
    """Whether :func:`~turbospark.layers.stacked.matmul_t` runs the kernel:
    :func:`available` and :func:`fits`."""
    return available() and fits(x, weight_t)


@functools.cache
def split_for(outputs: int, width: int, tiles: int = TILES) -> int:
    """Warps a block for a product of *outputs* by *width* at *tiles* tiles a
    warp: the power of two that brings the product's warps nearest
    :data:`WARPS_WANTED` without giving a warp less than one 32-value block."""
    blocks = -(-outputs // (8 * tiles))
    split = 1
    while split < MAX_SPLIT and blocks * split * 2 <= WARPS_WANTED and split * 2 <= width // 32:
        split *= 2
    return split


def fmv_ops(x: mx.array, weight_t: mx.array, addend: mx.array | None = None) -> mx.array:
    """The kernel's contract in MLX ops: ``x @ weight_t``, plus *addend* (a
    bias ``(N,)`` or a residual shaped as the product) as ``mx.addmm`` adds it."""
    return x @ weight_t if addend is None else mx.addmm(addend, x, weight_t)


def fmv(
    x: mx.array, weight_t: mx.array, addend: mx.array | None = None, tiles: int = TILES
) -> mx.array:
    """:func:`fmv_ops` in one kernel; callers check :func:`takes`. The kernel
    reads the weight ``(N, K)`` row by row: ``weight_t`` is a transposed view
    of it (:func:`~turbospark.layers.stacked.transposed`), so ``weight_t.T``
    is row-contiguous and passes uncopied. *tiles* (tiles of 8 outputs a
    warp) is the benchmark's knob (``bench/fmv.py --tiles``)."""
    width, outputs = weight_t.shape
    rows = x.size // width
    add = 0
    inputs = [x.reshape(rows, width), weight_t.T]
    if addend is not None:
        add = 1 if addend.ndim == 1 else 2
        inputs.append(addend if add == 1 else addend.reshape(rows, outputs))
    split = split_for(outputs, width, tiles)
    blocks = -(-outputs // (8 * tiles))
    (y,) = _kernel(add)(
        inputs=inputs,
        template=[("K", width), ("TILES", tiles), ("SPLIT", split), ("T", x.dtype)],
        grid=(blocks * split * 32, 1, 1),
        threadgroup=(split * 32, 1, 1),
        output_shapes=[(rows, outputs)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], outputs)
