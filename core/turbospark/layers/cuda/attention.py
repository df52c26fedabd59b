"""One-query attention (a decode step) as two CUDA kernels, on MLX's CUDA backend.

MLX 0.32's CUDA backend has no fused kernel for a decode step's attention, so
:func:`~turbospark.layers.attention.decode_attention` spends three launches a
layer on it: the scores' matmul, a softmax and the values' matmul. Both
matmuls go through cuBLAS, which MLX captures into a CUDA graph one call at a
time (in a profiler trace, the largest host cost of a step after the graph
launches themselves), and on a long context the values' product runs as a
split-N GEMM at 71 µs a call, where the bytes it reads take a microsecond or
two (14 % of gemma4's device time in a trace on the H200).

Here the keys are split into chunks (flash decoding) of :func:`chunk_keys`
keys: :data:`CHUNK` while the buffers hold at most :data:`MAX_SPLITS` of
those, longer past it (at 32k keys, chunks of 32 would write 16.8 MB of
float32 partials a global layer, and one merge block a head would walk 1,024
of them):

- :func:`decode`'s first kernel gives each block one row's key/value head
  and one chunk. Its warps walk the chunk's keys with every query head of
  that group held in registers (float32, scaled), keep an online softmax (the
  running max, the sum of weights, the weighted values), and merge their
  partial results through shared memory into one per head and chunk.
- the second merges a head's chunks (one block a head, its threads spread
  over the value columns and the chunks) and rounds once, to the queries'
  dtype.

Every sum is float32, so the result is the reference's math
(:func:`~turbospark.layers.attention.decode_attention`: scores and weights
rounded to the activations' dtype between its three kernels) without those
roundings.

The kernels take a :class:`~turbospark.state.kv.LayerKV`'s whole buffers and the
rows the query attends over as an int32 pair on the device (:class:`Rows`),
not the buffers sliced to those rows: every step's slice has a new shape, and
a lone row's :data:`decode_step` is traced once per buffer size and replayed
(Gemma 4's layers call :func:`decode` inside traces of their own, which hold
the rest of the layer too). Chunks past the last row hold no key and cost a
block that exits. A batch's step (:class:`~turbospark.state.kv.BatchLayerKV`:
rows right-aligned, left-padded) takes them too, with each row's first row
past its padding (``left``) on the device, and calls :func:`decode` as it is:
a batch's buffers take its rows' width at each merge, so traces kept per size
would pile up. Two kernels a layer, where the matmul form takes a masked
scores' product, a softmax and the values' product, each product a cuBLAS
call that MLX captures into its CUDA graph (about 20 µs of host time each,
against about 3 for one of these kernels).

``tests/test_attention_cuda.py`` checks the kernels against attention in
float64 on a GPU, and ``tests/test_attention_source.py`` runs their source as
C++ on the CPU against the same. On the CPU a decode step keeps MLX's op; there
:func:`decode_ops`, the contract in ops, stands in for the kernels, so the
tests check how the layers hand them a cache's buffers and rows
(``tests/test_attention_kernel_path.py``).
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from turbospark.layers import fused
from turbospark.layers.cuda import reduce as reduce_cuda
from turbospark.layers.cuda.kernel import Kernel

# TURBOSPARK_ATTENTION_KERNEL=0 keeps the matmul form on CUDA too (the
# benchmarks' A/B, as TURBOSPARK_GDN_KERNEL), read once at import.
ENABLED = os.environ.get("TURBOSPARK_ATTENTION_KERNEL", "1") != "0"
CHUNK = 32  # keys a block at least: a 2k context over two key/value heads is 128 blocks
# Chunks a head at most (TURBOSPARK_ATTENTION_SPLITS, read once at import):
# past CHUNK * MAX_SPLITS keys (8k) a chunk grows, in steps of CHUNK, and a
# block walks more keys instead of a head writing more partials. At 32k keys
# gemma4 `large` decoded ~20 % faster on an H100 with 256 (or 64) than with
# chunks of 32 at every length (docs/PERFORMANCE.md, the long prompts).
MAX_SPLITS = int(os.environ.get("TURBOSPARK_ATTENTION_SPLITS", "256"))
WARPS = 4  # warps a block; each takes every WARPS-th key of the chunk
# Registers a lane holds for the group's queries and their running outputs
# (G * (D + Dv) / 32 floats); past this the kernel would spill, so the matmul
# form takes the shape (G = 8 query heads a key head at D = Dv = 256 is 128).
MAX_REGISTERS = 160
SHARED_FLOATS = 8192  # 32 KiB of float32 partial outputs a block (G * Dv * warps)
MERGE_THREADS = 1024  # threads a merge block: its value columns, times the groups that fit

# Inputs: queries (B, KVH * G, 1, D); keys (B, KVH, N, D) and values (B, KVH, N,
# DV), a cache's whole buffers, each read through its strides; rows (2,) int32,
# the buffer rows [start, stop) the query attends over; for a batch, left (B,)
# int32, each row's first buffer row past its padding (a row attends from
# max(start, left[b])). Outputs, float32, for
# S = ceil(N / C) chunks of C = chunk_keys(N) rows from start (those past stop
# hold no key; C is computed here from N as chunk_keys does, so it needs no
# template of its own and a buffer's growth compiles nothing):
# partial_out (B, KVH * G, S, DV), each chunk's softmax-weighted values not yet
# divided by their weights' sum, and partial_stats (B, KVH * G, S, 2), the
# chunk's max score and the sum of its weights relative to that max (-inf and
# 0 for a chunk with no key).
_PARTIAL = """
    constexpr int ND = (D + 31) / 32;
    constexpr int NV = (DV + 31) / 32;
    __shared__ float s_max[NW][G];
    __shared__ float s_sum[NW][G];
    __shared__ float s_out[NW][G][DV];
    const int kv_heads = keys_shape[1];
    const int capacity = keys_shape[2];
    const int least = (capacity + MAX_SPLITS - 1) / MAX_SPLITS;
    const int chunk = max(CHUNK, (least + CHUNK - 1) / CHUNK * CHUNK);
    const int splits = (capacity + chunk - 1) / chunk;
    const int split = blockIdx.x % splits;
    const int kvh = (blockIdx.x / splits) % kv_heads;
    const int b = blockIdx.x / splits / kv_heads;
    const int first = FROM + split * chunk;
    const int end = min(rows[1], first + chunk);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    float q[G][ND];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const T* row = queries + b * queries_strides[0] + (kvh * G + g) * queries_strides[1];
#pragma unroll
        for (int i = 0; i < ND; ++i) {
            const int j = lane + 32 * i;
            q[g][i] = j < D ? static_cast<float>(row[j * queries_strides[3]]) * SCALE : 0.0f;
        }
    }
    float m[G], l[G], acc[G][NV];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; ++i) acc[g][i] = 0.0f;
    }
    const T* key_head = keys + b * keys_strides[0] + kvh * keys_strides[1];
    const T* value_head = values + b * values_strides[0] + kvh * values_strides[1];
    for (int t = first + warp; t < end; t += NW) {
        const T* key = key_head + t * keys_strides[2];
        float k[ND];
#pragma unroll
        for (int i = 0; i < ND; ++i) {
            const int j = lane + 32 * i;
            k[i] = j < D ? static_cast<float>(key[j * keys_strides[3]]) : 0.0f;
        }
        const T* value = value_head + t * values_strides[2];
        float v[NV];
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            const int j = lane + 32 * i;
            v[i] = j < DV ? static_cast<float>(value[j * values_strides[3]]) : 0.0f;
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < ND; ++i) dot += q[g][i] * k[i];
            const float score = warp_sum(dot);
            const float top = fmaxf(m[g], score);
            const float rescale = expf(m[g] - top);  // 0 for the first key (m = -infinity)
            const float weight = expf(score - top);
            l[g] = l[g] * rescale + weight;
#pragma unroll
            for (int i = 0; i < NV; ++i) acc[g][i] = acc[g][i] * rescale + weight * v[i];
            m[g] = top;
        }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane == 0) {
            s_max[warp][g] = m[g];
            s_sum[warp][g] = l[g];
        }
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            const int j = lane + 32 * i;
            if (j < DV) s_out[warp][g][j] = acc[g][i];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * DV; idx += NW * 32) {
        const int g = idx / DV;
        const int d = idx % DV;
        float top = NEG_INF;
        for (int w = 0; w < NW; ++w) top = fmaxf(top, s_max[w][g]);
        float total = 0.0f, out = 0.0f;
        if (top != NEG_INF) {
            for (int w = 0; w < NW; ++w) {
                const float weight = expf(s_max[w][g] - top);
                total += s_sum[w][g] * weight;
                out += s_out[w][g][d] * weight;
            }
        }
        const size_t at = (static_cast<size_t>(b * kv_heads + kvh) * G + g) * splits + split;
        partial_out[at * DV + d] = out;
        if (d == 0) {
            partial_stats[2 * at] = top;
            partial_stats[2 * at + 1] = total;
        }
    }
"""

# Inputs: partial_out and partial_stats as the first kernel wrote them. Output:
# out (B, H, 1, DV) in T. One block a (row, head) of GROUPS * DVP threads (DVP:
# DV rounded up to a warp). The chunks' max score and weights' sum are shared
# out over every thread and reduced across the block; the weighted outputs,
# one thread a value column, over GROUPS groups of threads, each summing every
# GROUPS-th chunk, then across the groups through shared memory. Each thread's
# loads are independent, so they overlap: at 68 chunks a call takes 5.3-7.4 us
# on the H200, where one thread a column walking every chunk in turn took 18.
_MERGE = """
    constexpr int THREADS = GROUPS * DVP;
    __shared__ float scratch[THREADS / 32];
    __shared__ float partial[GROUPS][DVP];
    const int splits = partial_out_shape[2];
    const int head = blockIdx.x;  // b * H + h
    const int d = threadIdx.x % DVP;
    const int group = threadIdx.x / DVP;
    const float* stats = partial_stats + static_cast<size_t>(head) * splits * 2;
    float top = NEG_INF;
    for (int s = threadIdx.x; s < splits; s += THREADS) top = fmaxf(top, stats[2 * s]);
    top = block_reduce<THREADS, true>(top, scratch);
    // A chunk with no key (past the last row: its max is -infinity) weighs 0.
    float total = 0.0f;
    for (int s = threadIdx.x; s < splits; s += THREADS) {
        const float l = stats[2 * s + 1];
        total += l == 0.0f ? 0.0f : l * expf(stats[2 * s] - top);
    }
    total = block_reduce<THREADS, false>(total, scratch);
    float sum = 0.0f;
    if (d < DV) {
        const float* column = partial_out + static_cast<size_t>(head) * splits * DV + d;
#pragma unroll 8
        for (int s = group; s < splits; s += GROUPS) {
            const float l = stats[2 * s + 1];
            const float weight = l == 0.0f ? 0.0f : expf(stats[2 * s] - top);
            sum += column[static_cast<size_t>(s) * DV] * weight;
        }
    }
    partial[group][d] = sum;
    __syncthreads();
    if (group == 0 && d < DV) {
        for (int g = 1; g < GROUPS; ++g) sum += partial[g][d];
        out[static_cast<size_t>(head) * DV + d] = static_cast<T>(sum / total);
    }
"""


def chunk_keys(capacity: int) -> int:
    """Keys a chunk over buffers of *capacity* rows: :data:`CHUNK`, or the
    least multiple of it that makes at most :data:`MAX_SPLITS` chunks (the
    partial kernel computes the same from its keys' shape)."""
    least = -(-capacity // MAX_SPLITS)
    return max(CHUNK, -(-least // CHUNK) * CHUNK)


def available() -> bool:
    """True where a decode step's attention takes these kernels (:func:`~turbospark.layers.fused.takes_cuda_kernels`)."""
    return fused.takes_cuda_kernels(ENABLED)


def warps(group: int, value_dim: int) -> int:
    """Warps a block: :data:`WARPS`, fewer where their partial outputs would
    not fit :data:`SHARED_FLOATS` of shared memory."""
    n = WARPS
    while n > 1 and n * group * value_dim > SHARED_FLOATS:
        n //= 2
    return n


def fits(group: int, dim: int, value_dim: int) -> bool:
    """Whether the kernels take this shape: a lane's queries and outputs fit
    :data:`MAX_REGISTERS`, and one warp's partial outputs fit shared memory."""
    lanes = (dim + 31) // 32 + (value_dim + 31) // 32
    return group * lanes <= MAX_REGISTERS and group * value_dim <= SHARED_FLOATS


def takes_shape(group: int, dim: int, value_dim: int) -> bool:
    """Whether a lone row's decode step over heads of this shape takes the
    kernels: :func:`available` and :func:`fits`."""
    return available() and fits(group, dim, value_dim)


@functools.cache
def _partial_kernel(scale: float, per_row: bool) -> Kernel:
    """The first kernel at *scale*; *per_row*: a batch's, whose rows each
    start at their own first row too (``left``, past their padding)."""
    literal = repr(float(scale))
    start = "max(rows[0], left[b])" if per_row else "rows[0]"
    return Kernel(
        name="turbospark_decode_attention",
        input_names=["queries", "keys", "values", "rows", *(["left"] if per_row else [])],
        output_names=["partial_out", "partial_stats"],
        source=f"    constexpr float SCALE = {literal}f;\n" + _PARTIAL.replace("FROM", start),
        header=reduce_cuda.HEADER,
    )


@functools.cache
def _merge_kernel() -> Kernel:
    return Kernel(
        name="turbospark_decode_attention_merge",
        input_names=["partial_out", "partial_stats"],
        output_names=["out"],
        source=_MERGE,
        header=reduce_cuda.HEADER,
    )


class Rows:
    """The buffer rows ``[start, stop)`` a decode step's query attends over,
    as :meth:`~turbospark.state.kv.LayerKV.update` gives them, on the device:
    the kernels' bounds, so a trace over a cache's whole buffers serves every
    position until the buffers grow. Stands where attention's mask goes in
    what a layer attended (KV-shared layers attend over the same). A batch's
    (:meth:`~turbospark.state.kv.BatchLayerKV.update`) carries *left* too,
    ``(B,)`` int32 on the device: each row's first buffer row past its
    padding, made once while the batch's rows stay the same."""

    def __init__(self, start: int, stop: int, left: mx.array | None = None):
        # Two int32, eight bytes: MLX's CUDA allocator serves that from its
        # small pool; a larger array made on the host each step reuses a
        # buffer the GPU last touched, and writing it migrates the page back
        # (a third element cost a gemma4 step 8 x 138 µs on the H200).
        self.bounds = mx.array([start, stop], dtype=mx.int32)
        self.left = left


def decode(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    rows: mx.array,
    scale: float,
    left: mx.array | None = None,
) -> mx.array:
    """``(B, heads, 1, Dv)``: the attention of one query a row ``(B, heads,
    1, D)`` over rows ``rows[0]:rows[1]`` (an int32 pair on the device) of
    the buffers ``(B, kv_heads, N, D)`` and ``(B, kv_heads, N, Dv)`` (the
    module docstring); with *left* ``(B,)`` int32, row ``b`` from
    ``max(rows[0], left[b])`` (a batch's padding). Callers check
    :func:`available` and :func:`fits`."""
    batch, heads, _, dim = queries.shape
    _, kv_heads, capacity, value_dim = values.shape
    group = heads // kv_heads
    splits = -(-capacity // chunk_keys(capacity))
    n_warps = warps(group, value_dim)
    partial_out, partial_stats = _partial_kernel(scale, left is not None)(
        inputs=[queries, keys, values, rows, *([] if left is None else [left])],
        template=[
            ("D", dim),
            ("DV", value_dim),
            ("G", group),
            ("NW", n_warps),
            ("CHUNK", CHUNK),
            ("MAX_SPLITS", MAX_SPLITS),
            ("T", queries.dtype),
        ],
        grid=(batch * kv_heads * splits * n_warps * 32, 1, 1),
        threadgroup=(n_warps * 32, 1, 1),
        output_shapes=[(batch, heads, splits, value_dim), (batch, heads, splits, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    column_threads = -(-value_dim // 32) * 32
    groups = max(1, MERGE_THREADS // column_threads)
    threads = groups * column_threads
    (out,) = _merge_kernel()(
        inputs=[partial_out, partial_stats],
        template=[
            ("DV", value_dim),
            ("DVP", column_threads),
            ("GROUPS", groups),
            ("T", queries.dtype),
        ],
        grid=(batch * heads * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(batch, heads, 1, value_dim)],
        output_dtypes=[queries.dtype],
    )
    return out


def decode_ops(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    rows: mx.array,
    scale: float,
    left: mx.array | None = None,
) -> mx.array:
    """:func:`decode`'s contract in MLX ops (MLX's attention over the whole
    buffers, masked to the rows *rows* and *left* name): the CPU tests'
    stand-in for the kernels (``tests/test_attention_kernel_path.py``). Reads
    *rows* and *left* on the device, as the kernels do, so it traces as they do."""
    index = mx.arange(keys.shape[2])
    first = rows[0] if left is None else mx.maximum(rows[0], left)[:, None, None, None]
    visible = (index >= first) & (index < rows[1])
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=visible)


# A lone row's, traced once per buffer size (a rung of the caches' growth ladder,
# each traced at load), then replayed: one call a layer instead of the two
# kernels' calls and their Python.
decode_step = mx.compile(decode)
