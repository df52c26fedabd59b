"""The gated delta rule as one CUDA kernel, for every length, on MLX's CUDA backend.

On a GPU a gated-DeltaNet layer is launch-bound: the chunked WY form
(:func:`~turbospark.layers.gated_delta.gated_delta_chunked`: masks, segment
sums, the doubling inverse, one carry per chunk) and the norm and gates
around it cost a prefill forward about 60 kernels a layer, a draft's verify
pass steps its tokens in two kernels each
(:func:`~turbospark.layers.gated_delta.mix_unrolled`), and even a decode
step spends a kernel each on the q/k norm, the gates and three pieces of the
update (``bench/gpu_kernels.py``, ~1B qwen_gdn: a 3 x 145 prefill group
1,088 kernels, 344 with this one; a verify pass 384, 216; a decode step 297,
261). Here one kernel does all of it for any number of tokens, as mlx-lm's
Metal kernel does on Apple GPUs (MLX's CUDA backend has none: mlx-lm falls back
to one token at a time in ops): a warp owns one row ``S[dv, :]`` of one value
head's state in registers and walks the tokens, so the sequential part costs
three warp reductions a token (the norms', off the state's chain, then what
the state predicts for ``k`` and the readout) and never leaves the chip.

Per token, for value head ``h`` (key head ``h // (Hv / Hk)``), with ``q`` and
``k`` L2-normalised (``q`` also scaled by ``Dk**-0.5``), ``g = exp(rate_h *
softplus(a))`` and ``beta = sigmoid(b)``:

    S <- g * S + beta * (v - g * S k) k^T,      y = S q

which is :func:`~turbospark.layers.gated_delta.gated_delta_step` with the norm
(:func:`~turbospark.layers.gated_delta.normalize_qk_heads`) and the gates
(:func:`~turbospark.layers.gated_delta.log_decay`) folded in, all in float32.
The kernel reads the conv's output ``[q | k | v]`` and the input projection
(whose ``a`` and ``b`` columns it reads in place) as they are, so no split,
norm or gate reaches the graph. With ``keep`` it also writes the state after
every token (a verify pass: a rejected draft's prefix takes its state from
there, nothing rebuilt), the last one in a buffer of its own as always.

Each row is computed alone, so a row's outputs do not depend on the batch it
runs in, and a prefill chunk, a decode step and a verify pass round the same
token the same way: batched equals alone and chunked equals stepping, bit for bit.

A decode step goes further (:func:`decode_mixer`): one block owns a row's
whole value head, so besides the recurrence it adds the projection's bias,
runs the causal conv over the conv tail and the new token (writing the new
tail), and makes the gated norm over the head's outputs: everything between
the layer's two GEMMs, where a step spent six launches besides the recurrence.

:func:`gated_delta_ops` is the same contract in MLX ops, one token at a time:
the stand-in through which the CPU's tests run the layers' kernel path
(``tests/test_gdn_kernel_path.py``, which also checks it against the layer's
reference pieces, as ``tests/test_gdn_cuda.py`` checks the kernel on a GPU);
:func:`decode_mixer_ops` is :func:`decode_mixer`'s.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
import mlx.nn as nn

from turbospark.layers import fused
from turbospark.layers.cuda import reduce as reduce_cuda
from turbospark.layers.cuda.kernel import Kernel
from turbospark.layers.gated_delta.gates import causal_conv_with_tail, gated_rms_norm

WARPS = 4  # warps per block: one block is WARPS rows of one value head's state
# TURBOSPARK_GDN_KERNEL=0 keeps the ops forms on CUDA too (a kill switch, as
# mlx-lm's MLX_GDN_PACKED; the benchmarks' A/B), read once at import.
ENABLED = os.environ.get("TURBOSPARK_GDN_KERNEL", "1") != "0"

_HEADER = (
    reduce_cuda.HEADER
    + """
__device__ inline float softplus(float x) {  // MLX's: logaddexp(x, 0)
    return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
}
"""
)

# Inputs: mixed (B, T, 2 * Hk * Dk + Hv * Dv), the conv's output after SiLU, q | k | v;
# proj (B, T, W), the input projection whose columns A_OFF .. A_OFF + Hv are a (its
# bias added) and the Hv after them b; rate (Hv,) float32, -exp(A_log); state_in
# (B, Hv, Dv, Dk) float32. Outputs: y (B, T, Hv, Dv) float32; state (B, Hv, Dv, Dk),
# the state after the last token; and in the keeping kernel (_KEEP spliced in),
# states (B, T, Hv, Dv, Dk), the state after every token.
_SOURCE = """
    constexpr int NK = (DK + 31) / 32;  // state columns per lane (lane + 32 i)
    constexpr int KEY_DIM = HK * DK;
    constexpr int CONV = 2 * KEY_DIM + HV * DV;
    const int batch = mixed_shape[0];
    const int steps = mixed_shape[1];
    const int width = proj_shape[2];
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= batch * HV * DV) return;
    const int dv = warp % DV;
    const int head = warp / DV;  // b * HV + hv
    const int hv = head % HV;
    const int b = head / HV;
    const int hk = hv / (HV / HK);
    const float rate_h = rate[hv];
    const float q_scale = rsqrtf(static_cast<float>(DK));
    float s[NK];
    const float* source = state_in + static_cast<size_t>(warp) * DK;
    for (int i = 0; i < NK; ++i) {
        const int j = lane + 32 * i;
        s[i] = j < DK ? source[j] : 0.0f;
    }
    for (int t = 0; t < steps; ++t) {
        const size_t token = static_cast<size_t>(b) * steps + t;
        const MixedT* m = mixed + token * CONV;
        const ProjT* p = proj + token * width;
        float q[NK], k[NK];
        float qq = 0.0f, kk = 0.0f;
        for (int i = 0; i < NK; ++i) {
            const int j = lane + 32 * i;
            q[i] = j < DK ? static_cast<float>(m[hk * DK + j]) : 0.0f;
            k[i] = j < DK ? static_cast<float>(m[KEY_DIM + hk * DK + j]) : 0.0f;
            qq += q[i] * q[i];
            kk += k[i] * k[i];
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        const float k_norm = rsqrtf(kk + 1e-6f);
        const float v = static_cast<float>(m[2 * KEY_DIM + hv * DV + dv]);
        const float g = expf(rate_h * softplus(static_cast<float>(p[A_OFF + hv])));
        const float beta = 1.0f / (1.0f + expf(-static_cast<float>(p[A_OFF + HV + hv])));
        float predicted = 0.0f;
        for (int i = 0; i < NK; ++i) {
            k[i] *= k_norm;
            predicted += s[i] * k[i];
        }
        predicted = warp_sum(predicted);  // what the old state holds for k
        const float delta = (v - g * predicted) * beta;
        float y = 0.0f;
        for (int i = 0; i < NK; ++i) {
            s[i] = g * s[i] + delta * k[i];
            y += s[i] * q[i];
        }
        y = warp_sum(y) * rsqrtf(qq + 1e-6f) * q_scale;
        if (lane == 0) out[(token * HV + hv) * DV + dv] = y;
        /*KEEP*/
    }
    float* last = state + static_cast<size_t>(warp) * DK;
    for (int i = 0; i < NK; ++i) {
        const int j = lane + 32 * i;
        if (j < DK) last[j] = s[i];
    }
"""
# The keeping kernel's write of the state after each token. The state after the
# last is written to `state` as well, a buffer of its own: a session that keeps it
# (the whole pass accepted) holds exactly its bytes, not the pass's every state.
_KEEP = """
        float* kept = states + ((token * HV + hv) * DV + dv) * DK;
        for (int i = 0; i < NK; ++i) {
            const int j = lane + 32 * i;
            if (j < DK) kept[j] = s[i];
        }
"""


def available() -> bool:
    """True where the gated-DeltaNet layers take this kernel (:func:`~turbospark.layers.fused.takes_cuda_kernels`)."""
    return fused.takes_cuda_kernels(ENABLED)


@functools.cache
def _kernel(keep: bool) -> Kernel:
    return Kernel(
        name="turbospark_gated_delta" + ("_keep" if keep else ""),
        input_names=["mixed", "proj", "rate", "state_in"],
        output_names=["out", "state", "states"] if keep else ["out", "state"],
        source=_SOURCE.replace("/*KEEP*/", _KEEP if keep else ""),
        header=_HEADER,
    )


def gated_delta(
    mixed: mx.array,
    proj: mx.array,
    rate: mx.array,
    state: mx.array,
    key_heads: int,
    value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    a_offset: int,
    keep: bool = False,
) -> tuple[mx.array, ...]:
    """The recurrence over *mixed*'s ``T`` tokens (see the module docstring):
    ``y`` ``(B, T, Hv, Dv)`` float32 and the state after the last token ``(B,
    Hv, Dv, Dk)``; with *keep*, also the state after every token ``(B, T, Hv,
    Dv, Dk)``. *a_offset* is the column of *proj* where ``a`` starts (``b``
    follows it)."""
    batch, length, _ = mixed.shape
    rows = batch * value_heads * value_head_dim  # one warp each
    every = (batch, length, value_heads, value_head_dim, key_head_dim)
    shapes = [every[:4], (batch, *every[2:])] + ([every] if keep else [])
    return tuple(
        _kernel(keep)(
            inputs=[mixed, proj, rate, state],
            template=[
                ("HK", key_heads),
                ("HV", value_heads),
                ("DK", key_head_dim),
                ("DV", value_head_dim),
                ("A_OFF", a_offset),
                ("MixedT", mixed.dtype),
                ("ProjT", proj.dtype),
            ],
            grid=(rows * 32, 1, 1),
            threadgroup=(32 * WARPS, 1, 1),
            output_shapes=shapes,
            output_dtypes=[mx.float32] * len(shapes),
        )
    )


# One decode step of the whole mixer between its two GEMMs, for a row's value
# head per block (B * HV blocks; each of its warps owns ROWS rows of the head's
# state). Inputs: proj (B, 1, W), the input projection without its bias: q | k |
# v (the conv's input, CONV columns), then z at Z_OFF, a at A_OFF and b after it;
# tail_in (B, KW - 1, CONV), the conv's last inputs, in proj's dtype; conv_w (CONV,
# KW, 1); bias (W,), the projection's bias (input_bias: dt_bias at a's columns);
# rate (HV,) float32; state_in (B, HV, DV, DK) float32; norm_w (DV,) float32, the
# gated norm's weight. Outputs: out (B, 1, HV * DV) in proj's dtype, the gated
# norm's output; state (B, HV, DV, DK); tail (B, KW - 1, CONV). Each step rounds
# where the ops round: the projection's sum with its bias and the conv to proj's
# dtype, everything else float32.
_DECODE_SOURCE = """
    constexpr int NK = (DK + 31) / 32;
    constexpr int KEY_DIM = HK * DK;
    constexpr int CONV = 2 * KEY_DIM + HV * DV;
    constexpr int GROUP = HV / HK;
    __shared__ float qk[2 * DK];  // this head's q | k after the conv and SiLU
    __shared__ float vs[DV];      // its v, then its readout y
    __shared__ float zs[DV];      // its gate z
    const int head = blockIdx.x;  // b * HV + hv
    const int hv = head % HV;
    const int b = head / HV;
    const int hk = hv / GROUP;
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int width = proj_shape[2];
    const ProjT* p = proj + static_cast<size_t>(b) * width;
    const ProjT* t_in = tail_in + static_cast<size_t>(b) * (KW - 1) * CONV;
    ProjT* t_out = tail + static_cast<size_t>(b) * (KW - 1) * CONV;
    for (int i = tid; i < 2 * DK + DV; i += blockDim.x) {
        const int c = i < DK ? hk * DK + i
                    : i < 2 * DK ? KEY_DIM + hk * DK + (i - DK)
                    : 2 * KEY_DIM + hv * DV + (i - 2 * DK);
        float acc = 0.0f;
        for (int j = 0; j < KW - 1; ++j)
            acc += static_cast<float>(t_in[j * CONV + c]) * static_cast<float>(conv_w[c * KW + j]);
        acc += static_cast<float>(p[c]) * static_cast<float>(conv_w[c * KW + KW - 1]);
        const float x = static_cast<float>(static_cast<ProjT>(acc));
        const float silu = x * (1.0f / (1.0f + expf(-x)));
        if (i < 2 * DK) qk[i] = silu; else vs[i - 2 * DK] = silu;
        if (i >= 2 * DK || hv % GROUP == 0) {  // each channel's tail written once
            for (int j = 0; j + 1 < KW - 1; ++j) t_out[j * CONV + c] = t_in[(j + 1) * CONV + c];
            t_out[(KW - 2) * CONV + c] = p[c];
        }
    }
    for (int i = tid; i < DV; i += blockDim.x) {
        const int c = Z_OFF + hv * DV + i;
        zs[i] = static_cast<float>(static_cast<ProjT>(
            static_cast<float>(p[c]) + static_cast<float>(bias[c])));
    }
    __syncthreads();
    const float a = static_cast<float>(static_cast<ProjT>(
        static_cast<float>(p[A_OFF + hv]) + static_cast<float>(bias[A_OFF + hv])));
    const float bb = static_cast<float>(static_cast<ProjT>(
        static_cast<float>(p[A_OFF + HV + hv]) + static_cast<float>(bias[A_OFF + HV + hv])));
    const float g = expf(rate[hv] * softplus(a));
    const float beta = 1.0f / (1.0f + expf(-bb));
    float q[NK], k[NK];
    float qq = 0.0f, kk = 0.0f;
    for (int i = 0; i < NK; ++i) {
        const int j = lane + 32 * i;
        q[i] = j < DK ? qk[j] : 0.0f;
        k[i] = j < DK ? qk[DK + j] : 0.0f;
        qq += q[i] * q[i];
        kk += k[i] * k[i];
    }
    qq = warp_sum(qq);
    kk = warp_sum(kk);
    const float k_norm = rsqrtf(kk + 1e-6f);
    const float q_norm = rsqrtf(qq + 1e-6f) * rsqrtf(static_cast<float>(DK));
    for (int i = 0; i < NK; ++i) k[i] *= k_norm;
    float ys[ROWS];
    for (int r = 0; r < ROWS; ++r) {
        const int dv = warp * ROWS + r;
        ys[r] = 0.0f;
        if (dv >= DV) break;
        const size_t row = (static_cast<size_t>(head) * DV + dv) * DK;
        float s[NK];
        float predicted = 0.0f;
        for (int i = 0; i < NK; ++i) {
            const int j = lane + 32 * i;
            s[i] = j < DK ? state_in[row + j] : 0.0f;
            predicted += s[i] * k[i];
        }
        predicted = warp_sum(predicted);  // what the old state holds for k
        const float delta = (vs[dv] - g * predicted) * beta;
        float y = 0.0f;
        for (int i = 0; i < NK; ++i) {
            const int j = lane + 32 * i;
            s[i] = g * s[i] + delta * k[i];
            y += s[i] * q[i];
            if (j < DK) state[row + j] = s[i];
        }
        ys[r] = warp_sum(y) * q_norm;
    }
    __syncthreads();  // every warp has read v: its rows' y take v's place
    if (lane == 0)
        for (int r = 0; r < ROWS && warp * ROWS + r < DV; ++r) vs[warp * ROWS + r] = ys[r];
    __syncthreads();
    float squares = 0.0f;
    for (int j = lane; j < DV; j += 32) squares += vs[j] * vs[j];
    const float inv = rsqrtf(warp_sum(squares) / DV + EPS);
    for (int i = tid; i < DV; i += blockDim.x) {
        const float gate = zs[i] * (1.0f / (1.0f + expf(-zs[i])));
        out[static_cast<size_t>(head) * DV + i] = static_cast<ProjT>(gate * (norm_w[i] * (vs[i] * inv)));
    }
"""


def rows_per_warp(value_head_dim: int) -> int:
    """State rows a warp of :func:`decode_mixer`'s block owns: a block holds a
    whole value head (at most 32 warps), since the gated norm sums over it."""
    return -(-value_head_dim // 32)


@functools.cache
def _decode_kernel(eps: float) -> Kernel:
    line, suffix = fused.eps_constant(eps)
    return Kernel(
        name=f"turbospark_gdn_decode_{suffix}",
        input_names=["proj", "tail_in", "conv_w", "bias", "rate", "state_in", "norm_w"],
        output_names=["out", "state", "tail"],
        source=line + _DECODE_SOURCE,
        header=_HEADER,
    )


def decode_mixer(
    proj: mx.array,
    tail: mx.array,
    conv_weight: mx.array,
    in_bias: mx.array,
    rate: mx.array,
    state: mx.array,
    norm_weight: mx.array,
    key_heads: int,
    value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    eps: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """One decode step of a gated-DeltaNet mixer after its input GEMM, as one
    kernel: the projection's bias, the causal conv over *tail* and the new
    token, SiLU, the q/k norm, the gates, the recurrence and the gated norm
    (:func:`decode_mixer_ops` in ops). *proj* ``(B, 1, W)`` is ``x @ in_proj_t``
    without its bias. Returns the ``(B, 1, Hv * Dv)`` output for ``out_proj``,
    the new state and the new conv tail ``(B, K - 1, C)``.

    A decode step spent six launches here besides the recurrence's: the bias
    add, the tail's concatenation, the conv with its SiLU, the gated norm and
    its gate (``bench/gpu_kernels.py``). A block owns a whole value head, so
    the norm over its ``Dv`` outputs stays on the chip."""
    batch = proj.shape[0]
    channels, kernel, _ = conv_weight.shape
    tail = tail.astype(proj.dtype)  # the conv's last inputs: the projection's own dtype
    rate, state, norm_weight = (a.astype(mx.float32) for a in (rate, state, norm_weight))
    rows = rows_per_warp(value_head_dim)
    threads = 32 * -(-value_head_dim // rows)
    return tuple(
        _decode_kernel(float(eps))(
            inputs=[proj, tail, conv_weight, in_bias, rate, state, norm_weight],
            template=[
                ("HK", key_heads),
                ("HV", value_heads),
                ("DK", key_head_dim),
                ("DV", value_head_dim),
                ("KW", kernel),
                ("ROWS", rows),
                ("Z_OFF", channels),
                ("A_OFF", channels + value_heads * value_head_dim),
                ("ProjT", proj.dtype),
                ("ConvT", conv_weight.dtype),
                ("BiasT", in_bias.dtype),
            ],
            grid=(batch * value_heads * threads, 1, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[
                (batch, 1, value_heads * value_head_dim),
                state.shape,
                (batch, kernel - 1, channels),
            ],
            output_dtypes=[proj.dtype, mx.float32, proj.dtype],
        )
    )


def decode_mixer_ops(
    proj: mx.array,
    tail: mx.array,
    conv_weight: mx.array,
    in_bias: mx.array,
    rate: mx.array,
    state: mx.array,
    norm_weight: mx.array,
    key_heads: int,
    value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    eps: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """:func:`decode_mixer`'s contract in MLX ops (its specification; any
    device): the layer's own pieces around :func:`gated_delta_ops`."""
    batch = proj.shape[0]
    value_dim = value_heads * value_head_dim
    conv_dim = conv_weight.shape[0]
    proj = (proj + in_bias).astype(proj.dtype)
    projected, z = proj[..., :conv_dim], proj[..., conv_dim : conv_dim + value_dim]
    conv, tail = causal_conv_with_tail(projected, tail, conv_weight)
    mixed = nn.silu(conv.astype(mx.float32))
    y, state = gated_delta_ops(
        mixed, proj, rate, state, key_heads, value_heads, key_head_dim, value_head_dim,
        conv_dim + value_dim,
    )  # fmt: skip
    z = z.reshape(batch, 1, value_heads, value_head_dim)
    out = gated_rms_norm(y, z, norm_weight, eps).reshape(batch, 1, value_dim)
    return out, state, tail


def gated_delta_ops(
    mixed: mx.array,
    proj: mx.array,
    rate: mx.array,
    state: mx.array,
    key_heads: int,
    value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    a_offset: int,
    keep: bool = False,
) -> tuple[mx.array, ...]:
    """:func:`gated_delta`'s contract in MLX ops, token by token in float32 (its
    specification; any device). Same arguments, same results up to the order
    of float32 sums."""
    batch, length, _ = mixed.shape
    key_dim = key_heads * key_head_dim
    group = value_heads // key_heads
    mixed = mixed.astype(mx.float32)

    def l2(x: mx.array) -> mx.array:  # (B, T, heads, Dk), repeated over each key head's group
        x = x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + 1e-6)
        return mx.repeat(x, group, axis=2) if group > 1 else x

    q = l2(mixed[..., :key_dim].reshape(batch, length, key_heads, key_head_dim))
    k = l2(mixed[..., key_dim : 2 * key_dim].reshape(batch, length, key_heads, key_head_dim))
    q = q * key_head_dim**-0.5
    v = mixed[..., 2 * key_dim :].reshape(batch, length, value_heads, value_head_dim)
    a = proj[..., a_offset : a_offset + value_heads].astype(mx.float32)
    b = proj[..., a_offset + value_heads : a_offset + 2 * value_heads].astype(mx.float32)
    g = mx.exp(rate * nn.softplus(a))  # (B, T, Hv)
    beta = mx.sigmoid(b)
    ys, states = [], []
    for t in range(length):
        kt = k[:, t, :, None, :]  # (B, Hv, 1, Dk)
        predicted = (state * kt).sum(axis=-1)  # (B, Hv, Dv): what the old state holds for k
        delta = (v[:, t] - g[:, t, :, None] * predicted) * beta[:, t, :, None]
        state = g[:, t, :, None, None] * state + delta[..., None] * kt
        ys.append((state * q[:, t, :, None, :]).sum(axis=-1))
        states.append(state)
    y = mx.stack(ys, axis=1)
    return (y, state, mx.stack(states, axis=1)) if keep else (y, state)
