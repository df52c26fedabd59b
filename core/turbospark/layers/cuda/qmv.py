"""A few rows times a packed (affine-quantized) weight as one CUDA kernel.

A decode step's products are a row (or a few) times every weight of the
model, so they are bound by the bytes of weight they read. MLX 0.32's CUDA
``mx.quantized_matmul`` reads a 4-bit checkpoint at about a fifth of an
H100's bandwidth for one row, so a 4-bit decode step that reads 3.6x fewer
bytes than a bfloat16 one was barely faster (docs/CUDA.md has the figures).
Here one warp owns one output of the product and walks its packed row in
16-byte loads (four uint32 a lane, :data:`UNROLL` of them in flight), with:

    y[r, n] = sum over groups g of
              scale[n, g] * sum(q * x[r])  +  bias[n, g] * sum(x[r])

over each group's values ``q`` (``value = scale * q + bias``, MLX's affine
packing, :func:`mx.quantize`): a lane's 16 bytes lie in one group (32 values
at 4 bits, 16 at 8, and groups are 32 to 128), so its scale and bias are
read once for them. The sums are float32, a lane's partial sums meet in a
warp shuffle, and the result rounds once to the activations' dtype. Each
packed value becomes a float without an integer conversion (those issue at
a quarter of an H100's float rate): its bits under the exponent of 2**23,
less 2**23, which is exact.

Only products of at most :data:`R_MAX` rows take it (every row's x is read
per weight chunk, so the arithmetic grows with the rows while the bytes do
not); everything else, and the CPU tests' stand-in for the kernel
(``tests/test_qmv_kernel_path.py``), runs :func:`qmv_ops`, the contract:
``mx.quantized_matmul`` with ``transpose=True``, which the kernel equals up
to the order of its float32 sums (``tests/test_qmv_cuda.py``, on a GPU).
:func:`~turbospark.layers.stacked.matmul_t` is the one caller.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from turbospark.layers import fused
from turbospark.layers.cuda import reduce as reduce_cuda

# TURBOSPARK_QMV_KERNEL=0 keeps mx.quantized_matmul on CUDA too (the
# benchmarks' A/B, as TURBOSPARK_NORM_KERNEL), read once at import.
ENABLED = os.environ.get("TURBOSPARK_QMV_KERNEL", "1") != "0"
R_MAX = 8  # rows of x a product may have to take the kernel (a batched decode step's)
BITS = (4, 8)  # the packings whose values split a uint32 evenly
GROUP_SIZES = (32, 64, 128)  # each a multiple of a lane's 16 bytes of values
DTYPES = (mx.float32, mx.bfloat16, mx.float16)
WARPS = 4  # warps (outputs) a block: 1,024 blocks for 4,096 outputs, 132 SMs filled
UNROLL = 4  # 16-byte weight loads a lane has in flight


def available() -> bool:
    """True where the layers take this kernel (:func:`~turbospark.layers.fused.takes_cuda_kernels`)."""
    return fused.takes_cuda_kernels(ENABLED)


# Float conversions the kernel shares: a small unsigned integer exactly, and a
# lane's run of x, in 16-byte loads where its address allows (a row-contiguous
# view may start anywhere), else one value at a time.
_HEADER = """
__device__ inline float small_uint_to_float(uint32_t q) {
    return __uint_as_float(0x4B000000u | q) - 8388608.0f;  // q < 2^23: (2^23 + q) - 2^23
}
template <typename T, int COUNT>
__device__ inline void load_floats(const T* p, float* out) {
    constexpr int PER_LOAD = 16 / sizeof(T);
    static_assert(COUNT % PER_LOAD == 0, "a lane's values fill whole 16-byte loads");
    if ((reinterpret_cast<size_t>(p) & 15) == 0) {
#pragma unroll
        for (int i = 0; i < COUNT / PER_LOAD; ++i) {
            const uint4 v = reinterpret_cast<const uint4*>(p)[i];
            const T* t = reinterpret_cast<const T*>(&v);
#pragma unroll
            for (int j = 0; j < PER_LOAD; ++j) out[i * PER_LOAD + j] = static_cast<float>(t[j]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < COUNT; ++i) out[i] = static_cast<float>(p[i]);
    }
}
"""

# One warp an output n (of w_shape[0]); lane l takes the row's 16-byte chunks
# l, l + 32, ... Inputs: x (ROWS, K) of T, w (N, K * BITS / 32) uint32, scales
# and biases (N, K / GS) of T; output y (ROWS, N) of T.
_SOURCE = """
    constexpr int PER_WORD = 32 / BITS;             // values a uint32 holds
    constexpr int PER_CHUNK = 4 * PER_WORD;         // values a lane's 16 bytes hold
    constexpr int CHUNKS = K / PER_CHUNK;           // 16-byte chunks a packed row
    constexpr int STEPS = (CHUNKS + 31) / 32;       // a warp's passes over a row
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    static_assert(K % GS == 0 && GS % PER_CHUNK == 0, "a chunk lies in one group");
    const int n_out = w_shape[0];
    const int n = blockIdx.x * WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (n >= n_out) return;  // the whole warp: its shuffles below never miss a lane
    const uint4* w_row = reinterpret_cast<const uint4*>(w) + static_cast<size_t>(n) * CHUNKS;
    const T* scale_row = scales + static_cast<size_t>(n) * (K / GS);
    const T* bias_row = biases + static_cast<size_t>(n) * (K / GS);
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
#pragma unroll
    for (int first = 0; first < STEPS; first += UNROLL) {
        uint4 packed[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = (first + u) * 32 + lane;
            packed[u] = c < CHUNKS ? w_row[c] : uint4{0u, 0u, 0u, 0u};
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = (first + u) * 32 + lane;
            if (c >= CHUNKS) continue;
            const int k0 = c * PER_CHUNK;
            const float scale = static_cast<float>(scale_row[k0 / GS]);
            const float bias = static_cast<float>(bias_row[k0 / GS]);
            const uint32_t words[4] = {packed[u].x, packed[u].y, packed[u].z, packed[u].w};
            float q[PER_CHUNK];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < PER_WORD; ++j)
                    q[i * PER_WORD + j] = small_uint_to_float((words[i] >> (BITS * j)) & MASK);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float xs[PER_CHUNK];
                load_floats<T, PER_CHUNK>(x + static_cast<size_t>(r) * K + k0, xs);
                float qx = 0.0f, sx = 0.0f;
#pragma unroll
                for (int i = 0; i < PER_CHUNK; ++i) {
                    qx = fmaf(q[i], xs[i], qx);
                    sx += xs[i];
                }
                acc[r] += scale * qx + bias * sx;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float total = warp_sum(acc[r]);
        if (lane == 0) y[static_cast<size_t>(r) * n_out + n] = static_cast<T>(total);
    }
"""


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(
        name="turbospark_qmv",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_SOURCE,
        header=reduce_cuda.HEADER + _HEADER,
    )


def fits(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str,
) -> bool:
    """Whether the kernel computes this product: MLX's affine packing at a
    supported width and group size, x ``(..., K)`` of at most :data:`R_MAX`
    rows matching the packed rows, scales and biases of x's float dtype."""
    if mode != "affine" or biases is None or bits not in BITS or group_size not in GROUP_SIZES:
        return False
    width = x.shape[-1] if x.ndim else 0
    return (
        width > 0
        and x.size // width <= R_MAX
        and w.ndim == 2
        and w.dtype == mx.uint32
        and w.shape[1] * 32 == width * bits
        and width % group_size == 0
        and x.dtype in DTYPES
        and scales.dtype == biases.dtype == x.dtype
        and scales.shape == biases.shape == (w.shape[0], width // group_size)
    )


def takes(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str,
) -> bool:
    """Whether :func:`~turbospark.layers.stacked.matmul_t` runs the kernel:
    :func:`available` and :func:`fits`."""
    return available() and fits(x, w, scales, biases, group_size, bits, mode)


def qmv_ops(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """The kernel's contract in MLX ops: ``x @ dequantize(w).T``, as
    ``nn.QuantizedLinear`` computes it."""
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode="affine"
    )


def qmv(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """:func:`qmv_ops` in one kernel; callers check :func:`takes`."""
    width, outputs = x.shape[-1], w.shape[0]
    blocks = -(-outputs // WARPS)
    (y,) = _kernel()(
        inputs=[x, w, scales, biases],
        template=[
            ("K", width),
            ("GS", group_size),
            ("BITS", bits),
            ("ROWS", x.size // width),
            ("WARPS", WARPS),
            ("UNROLL", UNROLL),
            ("T", x.dtype),
        ],
        grid=(blocks * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], outputs)],
        output_dtypes=[x.dtype],
    )
    return y
