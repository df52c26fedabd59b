"""A few rows times a packed (affine-quantized) weight as one CUDA kernel.

A decode step's products are a row (or a few) times every weight of the
model, so they are bound by the bytes of weight they read. MLX 0.32's CUDA
``mx.quantized_matmul`` reads a 4-bit checkpoint at about a fifth of an
H100's bandwidth for one row, so a 4-bit decode step that reads 3.6x fewer
bytes than a bfloat16 one was barely faster (docs/CUDA.md has the figures).
Here a warp owns :attr:`Variant.outs` adjacent outputs of the product and
walks their packed rows in 16-byte loads (four uint32 a lane an output,
:attr:`Variant.unroll` passes of them in flight), with:

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

The variants trade where a lane's x comes from, since at 4 bits a lane's 16
bytes of weight meet 64 bytes of bfloat16 x a row: several outputs a warp
reuse each x a lane converts (and keep more weight in flight), and
:attr:`Variant.shared_x` stages x once a block in shared memory as float
with each chunk's sum, so a row's x is read and converted once a block, not
once a warp. Every variant adds each output's terms in the same order (a
lane takes chunks ``lane, lane + 32, ...``; ``tests/test_qmv_source.py``
runs every variant's source as C++ and holds them equal, bit for bit). Which
is fastest for a (bits, rows) is measured (``python -m bench.qmv --outs 1 2
4 8 --shared-x 0 1``), and :data:`TABLE` holds the choice.

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
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from turbospark.layers import fused
from turbospark.layers.cuda import kernel
from turbospark.layers.cuda import reduce as reduce_cuda
from turbospark.layers.cuda.kernel import Kernel

# TURBOSPARK_QMV_KERNEL=0 keeps mx.quantized_matmul on CUDA too (the
# benchmarks' A/B, as TURBOSPARK_NORM_KERNEL), read once at import.
ENABLED = os.environ.get("TURBOSPARK_QMV_KERNEL", "1") != "0"
R_MAX = 8  # rows of x a product may have to take the kernel (a batched decode step's)
BITS = (4, 8)  # the packings whose values split a uint32 evenly
GROUP_SIZES = (32, 64, 128)  # each a multiple of a lane's 16 bytes of values
DTYPES = (mx.float32, mx.bfloat16, mx.float16)
WARPS = 4  # warps a block: 1,024 blocks for 4,096 outputs at one output a warp, 132 SMs filled
# Shared memory a block's staged x may fill (floats): 32 KiB, a tile of at
# least one warp pass, under the 48 KiB a kernel may declare statically (one
# pass of 8 rows at 4 bits is 36 KiB).
SHARED_FLOATS = 8192


class Variant(NamedTuple):
    """How the kernel spreads a product: outputs a warp, passes of 16-byte
    loads a lane has in flight an output, and whether x is staged in shared memory."""

    outs: int = 1
    unroll: int = 4
    shared_x: bool = False

    def __str__(self) -> str:
        return f"{self.outs},{self.unroll},{int(self.shared_x)}"


OUTS = (1, 2, 4, 8)  # the outputs a warp a variant may have
UNROLLS = (1, 2, 4, 8)
# The variant a product of these bits and at most these rows takes (the entry
# with the fewest rows at or above the product's); products no entry covers
# take DEFAULT, the one-output design measured first (``docs/CUDA.md``).
# From ``python -m bench.qmv``'s sweeps on H100s (``docs/CUDA.md``), which
# print this table: four outputs a warp for 8 rows; for one row, one output a
# warp, the faster at both the ~1B and the ~8B shape's products.
DEFAULT = Variant()
TABLE: dict[tuple[int, int], Variant] = {
    (4, 1): Variant(outs=1, unroll=4, shared_x=True),
    (4, 8): Variant(outs=4, unroll=4, shared_x=True),
    (8, 1): Variant(outs=1, unroll=4, shared_x=True),
    (8, 8): Variant(outs=4, unroll=4, shared_x=True),
}


def parse_variant(text: str) -> Variant:
    """``"OUTS,UNROLL,SHARED_X"`` (e.g. ``"4,2,1"``) as a :class:`Variant`,
    or a one-line error naming what is wrong and the form."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"qmv variant {text!r}: give OUTS,UNROLL,SHARED_X as three integers, e.g. 4,2,1"
        )
    outs, unroll, shared = (int(p) for p in parts)
    if outs not in OUTS or unroll not in UNROLLS or shared not in (0, 1):
        raise ValueError(
            f"qmv variant {text!r}: OUTS must be one of {OUTS}, UNROLL one of {UNROLLS}, SHARED_X 0 or 1"
        )
    return Variant(outs, unroll, bool(shared))


# TURBOSPARK_QMV_VARIANT=OUTS,UNROLL,SHARED_X makes every product take that
# variant (a whole model's A/B of one), read once at import.
FORCED = (
    parse_variant(os.environ["TURBOSPARK_QMV_VARIANT"])
    if os.environ.get("TURBOSPARK_QMV_VARIANT")
    else None
)


def variant_for(bits: int, rows: int) -> Variant:
    """The variant a product of *bits* and *rows* rows takes: the forced one,
    else :data:`TABLE`'s, else :data:`DEFAULT`."""
    if FORCED is not None:
        return FORCED
    covering = [(r, v) for (b, r), v in TABLE.items() if b == bits and r >= rows]
    return min(covering)[1] if covering else DEFAULT


def available() -> bool:
    """True where the layers take this kernel (:func:`~turbospark.layers.fused.takes_cuda_kernels`)."""
    return fused.takes_cuda_kernels(ENABLED)


# Float conversions the kernel shares: a small unsigned integer exactly, a
# lane's packed values, and a lane's run of x, in 16-byte loads where its address allows (a row-contiguous
# view may start anywhere), else one value at a time.
_HEADER = """
__device__ inline float small_uint_to_float(uint32_t q) {
    return __uint_as_float(0x4B000000u | q) - 8388608.0f;  // q < 2^23: (2^23 + q) - 2^23
}
// A lane's 16 bytes of packed values as floats, value j of word i at i * (32 / BITS) + j.
template <int BITS>
__device__ inline void unpack_chunk(const uint4 packed, float* q) {
    constexpr int PER_WORD = 32 / BITS;
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < PER_WORD; ++j)
            q[i * PER_WORD + j] = small_uint_to_float((words[i] >> (BITS * j)) & MASK);
    }
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

# Each warp computes OUTS adjacent outputs n0 .. n0 + OUTS - 1 (of w_shape[0]);
# lane l takes every output's 16-byte chunks l, l + 32, ... in that order, so
# each output's float32 sums are the same in every variant. Inputs: x (ROWS,
# K) of T, w (N, K * BITS / 32) uint32, scales and biases (N, K / GS) of T;
# output y (ROWS, N) of T. SHARED_X stages x in shared memory as float, TILE
# passes of the warp at a time: each chunk's values then their sum, padded to
# PER_CHUNK + 4 floats so a quarter-warp's 16-byte reads fall on distinct
# banks; a tile's first weight loads are issued before the staging. No thread returns early: every one reaches each barrier and shuffle
# (a past-the-end output reads the last row again and is not written).
_SOURCE = """
    constexpr int PER_WORD = 32 / BITS;             // values a uint32 holds
    constexpr int PER_CHUNK = 4 * PER_WORD;         // values a lane's 16 bytes hold
    constexpr int CHUNKS = K / PER_CHUNK;           // 16-byte chunks a packed row
    constexpr int STEPS = (CHUNKS + 31) / 32;       // a warp's passes over a row
    constexpr int GROUPS = K / GS;
    constexpr int STRIDE = PER_CHUNK + 4;           // floats a staged chunk: values, sum, pad
    constexpr int FIT = SHARED_FLOATS / (ROWS * 32 * STRIDE);
    constexpr int TILE = !SHARED_X ? STEPS : FIT < 1 ? 1 : FIT < STEPS ? FIT : STEPS;
    static_assert(K % GS == 0 && GS % PER_CHUNK == 0, "a chunk lies in one group");
    static_assert(!SHARED_X || ROWS * TILE * 32 * STRIDE * 4 <= 48 * 1024, "a tile fits static shared memory");
    const int n_out = w_shape[0];
    const int lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * WARPS + threadIdx.x / 32) * OUTS;
    int rows_of[OUTS];  // each output's packed row (the last one for outputs past the end)
#pragma unroll
    for (int o = 0; o < OUTS; ++o) rows_of[o] = n0 + o < n_out ? n0 + o : n_out - 1;
    __shared__ __align__(16) float x_tile[SHARED_X ? ROWS * TILE * 32 * STRIDE : 4];
    float acc[OUTS][ROWS];
#pragma unroll
    for (int o = 0; o < OUTS; ++o) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[o][r] = 0.0f;
    }
    uint4 packed[UNROLL][OUTS];  // a group of UNROLL passes' weight chunks, each output's
    // Loads the group of passes from `first` on in tile `tile` (zeros past the row's end).
    auto load_group = [&](int tile, int first) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = (tile + first + u) * 32 + lane;
#pragma unroll
            for (int o = 0; o < OUTS; ++o)
                packed[u][o] = first + u < TILE && c < CHUNKS
                    ? reinterpret_cast<const uint4*>(w)[static_cast<size_t>(rows_of[o]) * CHUNKS + c]
                    : uint4{0u, 0u, 0u, 0u};
        }
    };
    for (int tile = 0; tile < STEPS; tile += TILE) {
        if constexpr (SHARED_X) {
            load_group(tile, 0);  // the tile's first weights in flight while x is staged
            __syncthreads();  // every warp is done with the last tile
            for (int i = threadIdx.x; i < ROWS * TILE * 32; i += WARPS * 32) {
                const int r = i / (TILE * 32), j = i % (TILE * 32), c = tile * 32 + j;
                if (c >= CHUNKS) continue;
                float v[PER_CHUNK];
                load_floats<T, PER_CHUNK>(x + static_cast<size_t>(r) * K + c * PER_CHUNK, v);
                float4* staged = reinterpret_cast<float4*>(x_tile + i * STRIDE);
                float sum = 0.0f;
#pragma unroll
                for (int k = 0; k < PER_CHUNK; ++k) sum += v[k];
#pragma unroll
                for (int k = 0; k < PER_CHUNK / 4; ++k)
                    staged[k] = float4{v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]};
                staged[PER_CHUNK / 4] = float4{sum, 0.0f, 0.0f, 0.0f};
            }
            __syncthreads();
        }
#pragma unroll
        for (int first = 0; first < TILE; first += UNROLL) {
            if (!SHARED_X || first > 0) load_group(tile, first);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = (tile + first + u) * 32 + lane;
                if (first + u >= TILE || c >= CHUNKS) continue;
                const int g = c * PER_CHUNK / GS;
                float scale[OUTS], bias[OUTS];
#pragma unroll
                for (int o = 0; o < OUTS; ++o) {
                    scale[o] = static_cast<float>(scales[static_cast<size_t>(rows_of[o]) * GROUPS + g]);
                    bias[o] = static_cast<float>(biases[static_cast<size_t>(rows_of[o]) * GROUPS + g]);
                }
                if constexpr (SHARED_X) {
                    // A word of each output's values at a time, unpacked once
                    // for every row's staged x (a word's floats of x a row in
                    // registers, not the chunk's: the rows times the outputs'
                    // sums are what fills them).
                    float qx[OUTS][ROWS];
#pragma unroll
                    for (int o = 0; o < OUTS; ++o) {
#pragma unroll
                        for (int r = 0; r < ROWS; ++r) qx[o][r] = 0.0f;
                    }
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float q[OUTS][PER_WORD];
#pragma unroll
                        for (int o = 0; o < OUTS; ++o) {
                            const uint32_t word = i == 0 ? packed[u][o].x : i == 1 ? packed[u][o].y
                                                : i == 2 ? packed[u][o].z : packed[u][o].w;
#pragma unroll
                            for (int j = 0; j < PER_WORD; ++j)
                                q[o][j] = small_uint_to_float((word >> (BITS * j)) & ((1u << BITS) - 1u));
                        }
#pragma unroll
                        for (int r = 0; r < ROWS; ++r) {
                            const float4* staged = reinterpret_cast<const float4*>(
                                x_tile + ((r * TILE + first + u) * 32 + lane) * STRIDE + i * PER_WORD);
                            float xv[PER_WORD];
#pragma unroll
                            for (int v = 0; v < PER_WORD / 4; ++v) {
                                const float4 f = staged[v];
                                xv[4 * v] = f.x;
                                xv[4 * v + 1] = f.y;
                                xv[4 * v + 2] = f.z;
                                xv[4 * v + 3] = f.w;
                            }
#pragma unroll
                            for (int o = 0; o < OUTS; ++o) {
#pragma unroll
                                for (int j = 0; j < PER_WORD; ++j) qx[o][r] = fmaf(q[o][j], xv[j], qx[o][r]);
                            }
                        }
                    }
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        const float sx = x_tile[((r * TILE + first + u) * 32 + lane) * STRIDE + PER_CHUNK];
#pragma unroll
                        for (int o = 0; o < OUTS; ++o) acc[o][r] += fmaf(scale[o], qx[o][r], bias[o] * sx);
                    }
                } else {
                    // Each row's x read once and converted, then every output's values.
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        float xs[PER_CHUNK];
                        load_floats<T, PER_CHUNK>(x + static_cast<size_t>(r) * K + c * PER_CHUNK, xs);
                        float sx = 0.0f;
#pragma unroll
                        for (int i = 0; i < PER_CHUNK; ++i) sx += xs[i];
#pragma unroll
                        for (int o = 0; o < OUTS; ++o) {
                            float q[PER_CHUNK];
                            unpack_chunk<BITS>(packed[u][o], q);
                            float qx = 0.0f;
#pragma unroll
                            for (int i = 0; i < PER_CHUNK; ++i) qx = fmaf(q[i], xs[i], qx);
                            acc[o][r] += fmaf(scale[o], qx, bias[o] * sx);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int o = 0; o < OUTS; ++o) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float total = warp_sum(acc[o][r]);
            if (lane == 0 && n0 + o < n_out) y[static_cast<size_t>(r) * n_out + n0 + o] = static_cast<T>(total);
        }
    }
"""


def _template(
    width: int, group_size: int, bits: int, rows: int, variant: Variant, dtype: mx.Dtype
) -> list[tuple[str, int | mx.Dtype]]:
    outs, unroll, shared_x = variant
    return [
        ("K", width),
        ("GS", group_size),
        ("BITS", bits),
        ("ROWS", rows),
        ("WARPS", WARPS),
        ("OUTS", outs),
        ("UNROLL", unroll),
        ("SHARED_X", int(shared_x)),
        ("SHARED_FLOATS", SHARED_FLOATS),
        ("T", dtype),
    ]


def prebuild(model: nn.Module) -> int:
    """Start compiling, in the background (:func:`~turbospark.layers.cuda.kernel.prebuild`),
    every kernel *model*'s packed products may take where :func:`available`:
    each affine-packed linear's (and embedding's, a tied head's) width, group
    and bits, at 1 to :data:`R_MAX` rows of its scales' dtype (a decode step's
    rows, alone or batched). Returns how many were not kept already."""
    if not available():
        return 0
    packings = {
        (
            module.weight.shape[1] * 32 // module.bits,
            module.group_size,
            module.bits,
            module.scales.dtype,
        )
        for _, module in model.named_modules()
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
        and _packing_fits(module.mode, module.bits, module.group_size, module.scales.dtype)
    }
    return kernel.prebuild(
        _kernel().source(
            [(dtype, 2), (mx.uint32, 2), (dtype, 2), (dtype, 2)],
            [dtype],
            _template(width, group_size, bits, rows, variant_for(bits, rows), dtype),
        )
        for width, group_size, bits, dtype in sorted(packings, key=str)
        for rows in range(1, R_MAX + 1)
    )


@functools.cache
def _kernel() -> Kernel:
    return Kernel(
        name="turbospark_qmv",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_SOURCE,
        header=reduce_cuda.HEADER + _HEADER,
    )


def _packing_fits(mode: str, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes this packing of activations of *dtype*: MLX's
    affine one at a width and group size it splits evenly."""
    return mode == "affine" and bits in BITS and group_size in GROUP_SIZES and dtype in DTYPES


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
    if biases is None or not _packing_fits(mode, bits, group_size, x.dtype):
        return False
    width = x.shape[-1] if x.ndim else 0
    return (
        width > 0
        and x.size // width <= R_MAX
        and w.ndim == 2
        and w.dtype == mx.uint32
        and w.shape[1] * 32 == width * bits
        and width % group_size == 0
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
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    variant: Variant | None = None,
) -> mx.array:
    """:func:`qmv_ops` in one kernel; callers check :func:`takes`. *variant*
    (the benchmark's and tests' choice) defaults to :func:`variant_for`'s."""
    width, outputs = x.shape[-1], w.shape[0]
    rows = x.size // width
    variant = variant or variant_for(bits, rows)
    blocks = -(-outputs // (WARPS * variant.outs))
    (y,) = _kernel()(
        inputs=[x, w, scales, biases],
        template=_template(width, group_size, bits, rows, variant, x.dtype),
        grid=(blocks * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], outputs)],
        output_dtypes=[x.dtype],
    )
    return y
