"""A decode step's attention heads, normed and rotated, as one CUDA kernel.

Gemma layers RMS-norm every head they project: queries and keys with their
norm's weight, then RoPE; values with no weight and no rotation. In ops
(:func:`norm_rope_ops`) a K/V-owning layer spends three kernels on it (the
norm of every head, the weights' multiply, RoPE) and a KV-shared layer two,
where a decode step is bound by its launches and their host time. Here one
block owns one head of one row, one thread a pair ``(i, i + D/2)`` that RoPE
rotates together, and does all of it:

    y = rms_norm(x)          rounded to the activations' dtype
    y = y * w                the first W heads: their norm's weight
    y = rope(y, start)       those W heads too (non-traditional pairs)

The heads come in as the projection lays them out: ``heads`` query heads,
then (a K/V-owning layer) ``kv_heads`` key heads, then the value heads when
the layer has its own, and they leave as ``(B, n, 1, D)`` queries, keys and
values. With ``attention_k_eq_v`` the values are the key heads before their
weight and rotation. Each step rounds where the ops do (``mx.fast.rms_norm``
rounds the normed head before a weight's multiply, RoPE rotates in float32
and rounds once), so the kernel differs from its ops only in the order of a
head's float32 sum of squares and in how CUDA's ``cos`` and ``sin`` round.

Only a lone row's decode step takes it (Gemma 4's layer traces); everything
else, and the CPU tests' stand-in for the kernel
(``tests/test_attention_kernel_path.py``), runs :func:`norm_rope_ops`.
``tests/test_heads_cuda.py`` checks the kernel against it on a GPU.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from turbospark.layers import fused
from turbospark.layers.attention import normed_heads
from turbospark.layers.cuda import reduce as reduce_cuda
from turbospark.layers.cuda.kernel import Kernel
from turbospark.layers.rope import apply_rope

# TURBOSPARK_HEADS_KERNEL=0 keeps the ops on CUDA too (the benchmarks' A/B, as
# TURBOSPARK_NORM_KERNEL), read once at import.
ENABLED = os.environ.get("TURBOSPARK_HEADS_KERNEL", "1") != "0"


def available() -> bool:
    """True where the families take this kernel (:func:`~turbospark.layers.fused.takes_cuda_kernels`)."""
    return fused.takes_cuda_kernels(ENABLED)


# One block a (row, head); thread i holds the head's values i and i + D/2.
# T is the activations' dtype. {STORE} writes what a head leaves as: spliced
# per variant, since a KV-shared layer's kernel has no keys or values to name.
_SOURCE = """
    constexpr int HALF = D / 2;
    __shared__ float scratch[HALF / 32];
    const int row = blockIdx.x / N_IN, head = blockIdx.x % N_IN, i = threadIdx.x;
    const size_t in_base = (static_cast<size_t>(row) * N_IN + head) * D;
    const float a = static_cast<float>(x[in_base + i]);
    const float b = static_cast<float>(x[in_base + i + HALF]);
    const float inv = rsqrtf(block_sum<HALF>(a * a + b * b, scratch) / D + EPS);
    const T na = static_cast<T>(a * inv), nb = static_cast<T>(b * inv);
    T ra = na, rb = nb;
    if (head < W) {
        const float sa = static_cast<float>(weight[head * D + i] * na);
        const float sb = static_cast<float>(weight[head * D + i + HALF] * nb);
        const float inv_freq = 1.0 / freqs[i];
        const float theta = static_cast<float>(offset[0]) * inv_freq;
        const float c = cos(theta), s = sin(theta);
        ra = static_cast<T>(sa * c - sb * s);
        rb = static_cast<T>(sa * s + sb * c);
    }
    {STORE}
"""
_STORE_QUERIES = """
    const size_t out = (static_cast<size_t>(row) * Q + head) * D;
    queries[out + i] = ra;
    queries[out + i + HALF] = rb;
"""
_STORE_ALL = """
    if (head < Q) {
        const size_t out = (static_cast<size_t>(row) * Q + head) * D;
        queries[out + i] = ra;
        queries[out + i + HALF] = rb;
    } else if (head < Q + KV) {
        const size_t out = (static_cast<size_t>(row) * KV + head - Q) * D;
        keys[out + i] = ra;
        keys[out + i + HALF] = rb;
        if (V_FROM_K) {
            values[out + i] = na;
            values[out + i + HALF] = nb;
        }
    } else {
        const size_t out = (static_cast<size_t>(row) * KV + head - Q - KV) * D;
        values[out + i] = na;
        values[out + i + HALF] = nb;
    }
"""


@functools.cache
def _kernel(owner: bool, eps: float) -> Kernel:
    eps_line, eps_name = fused.eps_constant(eps)
    return Kernel(
        name=f"turbospark_heads_norm_rope_{'qkv' if owner else 'q'}_{eps_name}",
        input_names=["x", "weight", "offset", "freqs"],
        output_names=["queries", "keys", "values"] if owner else ["queries"],
        source=eps_line + _SOURCE.replace("{STORE}", _STORE_ALL if owner else _STORE_QUERIES),
        header=reduce_cuda.HEADER,
    )


def norm_rope_ops(
    x: mx.array,
    weight: mx.array,
    start: int | mx.array,
    freqs: mx.array,
    heads: int,
    kv_heads: int,
    eps: float,
) -> tuple[mx.array, ...]:
    """The kernel's contract in MLX ops (the module docstring), for any
    ``(B, L, n*D)`` projection (or a step's ``(B, n*D)``): *weight* ``(W, 1,
    D)`` is each scaled head's norm weight, *start* RoPE's offset. The
    queries ``(B, heads, L, D)`` alone where *kv_heads* is 0 (a KV-shared
    layer), else queries, keys and values. Every head is normed at once
    without a weight, the W heads then scaled in one multiply and rotated in
    one RoPE: ``RMSNorm(x) * w`` is ``nn.RMSNorm``'s math, rounded once more
    in between (three kernels where the heads one by one take five)."""
    dim = weight.shape[-1]
    normed = normed_heads(x, x.shape[-1] // dim, None, eps)  # (B, n, L, D)
    scaled = weight.shape[0]
    rotated = apply_rope(normed[:, :scaled] * weight, start, dim, freqs)
    if kv_heads == 0:
        return (rotated,)
    values = normed[:, scaled:] if normed.shape[1] > scaled else normed[:, heads:]
    return rotated[:, :heads], rotated[:, heads:], values


def takes(x: mx.array, weight: mx.array, start: mx.array) -> bool:
    """Whether :func:`norm_rope` runs the kernel: :func:`available`, a
    decode step's ``(B, n*D)`` with *weight* of its dtype, one offset, and a
    head dim whose pairs fill whole warps of one block."""
    dim = weight.shape[-1]
    return (
        dim % 64 == 0
        and dim <= 2048
        and x.ndim == 2
        and start.size == 1
        and weight.dtype == x.dtype
        and available()
    )


def norm_rope(
    x: mx.array,
    weight: mx.array,
    start: mx.array,
    freqs: mx.array,
    heads: int,
    kv_heads: int,
    eps: float,
) -> tuple[mx.array, ...]:
    """:func:`norm_rope_ops` in one kernel where it :func:`takes` these
    arrays, else in its ops."""
    if not takes(x, weight, start):
        return norm_rope_ops(x, weight, start, freqs, heads, kv_heads, eps)
    dim = weight.shape[-1]
    batch, n_in = x.shape[0], x.shape[1] // dim
    scaled = weight.shape[0]
    outputs = [(batch, heads, 1, dim)]
    if kv_heads:
        outputs += [(batch, kv_heads, 1, dim)] * 2
    return tuple(
        _kernel(kv_heads > 0, eps)(
            inputs=[x, weight, start.astype(mx.int32), freqs.astype(mx.float32)],
            template=[
                ("D", dim),
                ("N_IN", n_in),
                ("W", scaled),
                ("Q", heads),
                ("KV", kv_heads),
                ("V_FROM_K", int(n_in == scaled)),
                ("T", x.dtype),
            ],
            grid=(batch * n_in * dim // 2, 1, 1),
            threadgroup=(dim // 2, 1, 1),
            output_shapes=outputs,
            output_dtypes=[x.dtype] * len(outputs),
        )
    )
