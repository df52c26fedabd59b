"""A few rows times a float weight as one CUDA kernel (a server's batched decode step).

On MLX 0.32's CUDA backend a float product of one row is MLX's gemv, one
kernel node, but every product of more than one row goes to cuBLASLt, and
MLX sets up each such call anew: new matrix descriptors, a heuristic query
for the algorithm, a workspace, and the call captured into its graph. A
batched decode step has about a hundred of them, and its host time (the
step is bound by it) is mostly MLX encoding them (``docs/CUDA.md``,
``bench/encode_cost.py``). Here a product of at most :data:`R_MAX` rows is
one custom kernel, encoded as one kernel node.

A block owns :data:`OUTS` adjacent outputs, and its :data:`WARPS` warps split
the width: lane ``l`` of warp ``w`` takes the 16-byte chunks ``w * 32 + l``,
``+ WARPS * 32``, ... of each output's weight row and every row's x over the
same columns, so each x chunk a lane converts serves its block's outputs.
The float32 sums (``OUTS * R_MAX`` a lane) are then reduced over the warp by
halving exchanges (each of five shuffle rounds hands half of a lane's sums to
its partner, so a lane ends with two) and over the block's warps through
shared memory, and round once to the activations' dtype. The weight is read
through its strides (a layer keeps ``weight.T``, a view of ``(out, in)``
rows, :class:`~turbospark.layers.stacked.Stacked`), in 16-byte loads where
its rows are contiguous and aligned, else one value at a time; so is x.

The rows are a runtime bound under :data:`R_MAX`, so one compiled kernel a
dtype serves every batch size (no compile when a server's batch grows).
:func:`~turbospark.layers.stacked.matmul_t` is the one caller; elsewhere, and
in the CPU tests' stand-in (``tests/test_fmv_kernel_path.py``), the product is
:func:`fmv_ops`, the contract, which the kernel equals up to the order of its
float32 sums (``tests/test_fmv_cuda.py``, on a GPU). It is taken only with
``TURBOSPARK_FMV_KERNEL=1`` until that has run (:data:`ENABLED`).
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from turbospark.layers import fused
from turbospark.layers.cuda import reduce as reduce_cuda

# TURBOSPARK_FMV_KERNEL=1 takes the kernel (read once at import). Off by
# default: its GPU tests (tests/test_fmv_cuda.py) and its speed against
# cuBLASLt (bench/server_step.py, one process each way) have not run on a GPU
# yet, and a server's every batched step would go through it.
ENABLED = os.environ.get("TURBOSPARK_FMV_KERNEL", "0") == "1"
R_MIN = 2  # one row is MLX's own gemv, one kernel node already
R_MAX = 16  # rows a product may have (a server's batch); OUTS * R_MAX sums a lane
OUTS = 4  # outputs a block: each converted x chunk serves this many weight rows
WARPS = 4  # warps a block, splitting the width
DTYPES = (mx.float32, mx.bfloat16, mx.float16)

# Inputs: x (R, K) and w (K, N), each of T and read through its strides (w is
# a weight's transpose view: w[k, n] at k * w_strides[0] + n * w_strides[1]);
# output y (R, N). Block b computes outputs n0 = b * OUTS .. n0 + OUTS - 1
# (past-the-end ones read the last output's row and are not written).
_SOURCE = """
    constexpr int PER = 16 / sizeof(T);           // values a 16-byte load holds
    constexpr int V = OUTS * R_MAX;               // a lane's sums, output-major
    static_assert(V % 32 == 0 && (V & (V - 1)) == 0, "the sums halve over five rounds");
    const int rows = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[1];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int n0 = blockIdx.x * OUTS;
    const int64_t xs0 = x_strides[0], xs1 = x_strides[1];
    const int64_t ws0 = w_strides[0], ws1 = w_strides[1];
    int64_t row_of[OUTS];  // each output's first weight element
#pragma unroll
    for (int o = 0; o < OUTS; ++o) row_of[o] = static_cast<int64_t>(n0 + o < N ? n0 + o : N - 1) * ws1;
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.0f;
    const bool vector = ws0 == 1 && xs1 == 1 && K % PER == 0 && ws1 % PER == 0 && xs0 % PER == 0
        && (reinterpret_cast<size_t>(w) & 15) == 0 && (reinterpret_cast<size_t>(x) & 15) == 0;
    if (vector) {
        for (int c = warp * 32 + lane; c < K / PER; c += WARPS * 32) {
            float wv[OUTS][PER];
#pragma unroll
            for (int o = 0; o < OUTS; ++o) {
                const uint4 packed = *reinterpret_cast<const uint4*>(w + row_of[o] + c * PER);
                const T* t = reinterpret_cast<const T*>(&packed);
#pragma unroll
                for (int j = 0; j < PER; ++j) wv[o][j] = static_cast<float>(t[j]);
            }
#pragma unroll
            for (int r = 0; r < R_MAX; ++r) {
                if (r < rows) {  // a guard, not a break: the loop unrolls and acc stays in registers
                    const uint4 packed = *reinterpret_cast<const uint4*>(x + r * xs0 + c * PER);
                    const T* t = reinterpret_cast<const T*>(&packed);
#pragma unroll
                    for (int j = 0; j < PER; ++j) {
                        const float xv = static_cast<float>(t[j]);
#pragma unroll
                        for (int o = 0; o < OUTS; ++o) acc[o * R_MAX + r] = fmaf(wv[o][j], xv, acc[o * R_MAX + r]);
                    }
                }
            }
        }
    } else {
        for (int k = warp * 32 + lane; k < K; k += WARPS * 32) {
            float wv[OUTS];
#pragma unroll
            for (int o = 0; o < OUTS; ++o) wv[o] = static_cast<float>(w[row_of[o] + k * ws0]);
#pragma unroll
            for (int r = 0; r < R_MAX; ++r) {
                if (r < rows) {
                    const float xv = static_cast<float>(x[r * xs0 + k * xs1]);
#pragma unroll
                    for (int o = 0; o < OUTS; ++o) acc[o * R_MAX + r] = fmaf(wv[o], xv, acc[o * R_MAX + r]);
                }
            }
        }
    }
    // Five rounds, offsets 16 .. 1: a lane keeps the half of its live sums its
    // offset's bit selects and adds its partner's; lane l ends holding sums
    // l * (V / 32) .. + V / 32 - 1 of the warp.
#pragma unroll
    for (int s = 0; s < 5; ++s) {
        const int offset = 16 >> s;
        const int half = V >> (s + 1);
        const bool upper = (lane & offset) != 0;
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const float send = upper ? acc[i] : acc[i + half];
            const float keep = upper ? acc[i + half] : acc[i];
            acc[i] = keep + __shfl_xor_sync(0xffffffff, send, offset);
        }
    }
    __shared__ float partial[WARPS][V];
#pragma unroll
    for (int j = 0; j < V / 32; ++j) partial[warp][lane * (V / 32) + j] = acc[j];
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += WARPS * 32) {
        const int o = i / R_MAX, r = i % R_MAX;
        if (r >= rows || n0 + o >= N) continue;
        float total = 0.0f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) total += partial[v][i];
        y[static_cast<int64_t>(r) * N + n0 + o] = static_cast<T>(total);
    }
"""


def available() -> bool:
    """True where the layers take this kernel (:func:`~turbospark.layers.fused.takes_cuda_kernels`)."""
    return fused.takes_cuda_kernels(ENABLED)


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(
        name="turbospark_fmv",
        input_names=["x", "w"],
        output_names=["y"],
        source=_SOURCE,
        header=reduce_cuda.HEADER,
        # The weight is a transpose view: copying it row-contiguous would read it twice.
        ensure_row_contiguous=False,
    )


def fits(x: mx.array, weight_t: mx.array) -> bool:
    """Whether the kernel computes ``x @ weight_t``: x ``(..., K)`` of
    :data:`R_MIN` to :data:`R_MAX` rows, a two-dimensional ``(K, N)`` weight of
    x's float dtype."""
    width = x.shape[-1] if x.ndim else 0
    return (
        width > 0
        and R_MIN <= x.size // width <= R_MAX
        and weight_t.ndim == 2
        and weight_t.shape[0] == width
        and x.dtype in DTYPES
        and weight_t.dtype == x.dtype
    )


def takes(x: mx.array, weight_t: mx.array) -> bool:
    """Whether :func:`~turbospark.layers.stacked.matmul_t` runs the kernel:
    :func:`available` and :func:`fits`."""
    return available() and fits(x, weight_t)


def fmv_ops(x: mx.array, weight_t: mx.array) -> mx.array:
    """The kernel's contract in MLX ops: ``x @ weight_t``."""
    return x @ weight_t


def fmv(x: mx.array, weight_t: mx.array) -> mx.array:
    """:func:`fmv_ops` in one kernel; callers check :func:`takes`."""
    width, outputs = x.shape[-1], weight_t.shape[1]
    (y,) = _kernel()(
        inputs=[x.reshape(-1, width), weight_t],
        template=[("R_MAX", R_MAX), ("OUTS", OUTS), ("WARPS", WARPS), ("T", x.dtype)],
        grid=(-(-outputs // OUTS) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(x.size // width, outputs)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], outputs)
