"""Gated DeltaNet's gates, q/k normalisation, causal convolution and gated norm: the pieces around the recurrence."""

from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from turbospark.layers.stacked import WeightT, columns, derived

# -- gates and normalisation --------------------------------------------------


@partial(mx.compile, shapeless=True)
def log_decay(rate: mx.array, a: mx.array) -> mx.array:
    """``log g = -exp(A_log) * softplus(a + dt_bias)`` in float32 (``(B, T, Hv)``),
    with ``rate = -exp(A_log)`` in float32 (:func:`decay_rate`, computed once)
    and *a* the projection with ``dt_bias`` added (by its GEMM: :func:`input_bias`).

    The chunked form needs the log (decays multiply, so their logs add); the
    step takes ``exp`` of the same value, which is what mlx-lm's ``compute_g`` is.
    """
    return rate * nn.softplus(a)


def input_bias(dt_bias: mx.array, columns: int) -> mx.array:
    """The input projections' bias, ``(columns,)``: zero but ``dt_bias`` at
    ``a``'s columns (qkv | z | a | b), so the projection adds it
    (:func:`~turbospark.layers.stacked.gemm_add`: the GEMM's C operand, no
    kernel of its own, wherever the product has several rows) where ``a +
    dt_bias`` was a kernel a layer and token (its sum is broadcast into the
    update, which a compiled step does not fuse across)."""
    heads = dt_bias.shape[0]
    zeros = mx.zeros((columns - 2 * heads,), dt_bias.dtype)
    return mx.concatenate([zeros, dt_bias, mx.zeros((heads,), dt_bias.dtype)])


def mixer_input_bias(mixer: nn.Module, in_proj_t: WeightT) -> mx.array:
    """*mixer*'s :func:`input_bias` for its stacked projections *in_proj_t*, in
    their dtype (a float32 bias would promote the GEMM; packed ones compute in
    the model's, ``dt_bias``'s), built once per ``dt_bias``, width and dtype
    (:func:`derived`; projections replaced under the same ``dt_bias``, by
    another dtype or quantized, read a bias of their own)."""
    width = columns(in_proj_t)
    dtype = in_proj_t.dtype if isinstance(in_proj_t, mx.array) else mixer["dt_bias"].dtype
    name = _input_bias_name(width, dtype)
    return derived(mixer, name, mixer["dt_bias"], lambda dt: input_bias(dt.astype(dtype), width))


@lru_cache
def _input_bias_name(width: int, dtype: mx.Dtype) -> str:
    """Where :func:`mixer_input_bias` keeps a bias of *width* and *dtype*;
    cached, as formatting it cost a gated-DeltaNet layer about 0.4 µs of
    host time a step."""
    return f"_input_bias/{width}/{dtype}"


def decay_rate(mixer: nn.Module) -> mx.array:
    """*mixer*'s ``-exp(A_log)`` in float32, computed once per ``A_log``
    (:func:`~turbospark.layers.stacked.derived`). It is a constant: computed
    in the step, it is a kernel of its own there (its input a reshaped leaf,
    which a compiled step does not fuse across), one a GDN layer and token."""
    return derived(mixer, "_decay_rate", mixer["A_log"], lambda a: -mx.exp(a.astype(mx.float32)))


def normalize_qk(q: mx.array, k: mx.array, eps: float = 1e-6) -> tuple[mx.array, mx.array]:
    """L2-normalise q and k over ``Dk``, folding the ``Dk**-0.5`` readout scale
    into q (:func:`normalize_qk_heads` on the two stacked along the heads)."""
    return normalize_qk_heads(mx.concatenate([q, k], axis=2), eps)


def normalize_qk_heads(
    qk: mx.array, eps: float = 1e-6, as_keys: bool = False
) -> tuple[mx.array, mx.array]:
    """:func:`normalize_qk` of q and k stacked along the heads, ``(B, L, 2 * Hk,
    Dk)`` with q's heads first (as the conv output holds them): one norm kernel
    for both, each row normalised alone as before.

    The reference adds ``eps`` to ``sum(x^2)``; ``rms_norm`` adds its eps to
    ``mean(x^2)``, hence the eps is divided by ``Dk``.

    *as_keys* (one token, :func:`mix`; *qk* float32): q scaled as k is, by
    ``Dk**-0.5`` (not ``Dk**-1``), the scale the norm's weight (:func:`_key_scale`),
    so the norm is the only kernel, where a scale and a cast took one more;
    the readout ``S q`` is then ``Dk**0.5`` times too large, and its only
    reader, the gated RMSNorm, absorbs that in its eps.
    """
    dim = qk.shape[-1]
    inv_scale = dim**-0.5
    if as_keys:
        normed = mx.fast.rms_norm(qk, _key_scale(dim), eps * inv_scale**2)
        return tuple(mx.split(normed, 2, axis=2))
    normed = mx.fast.rms_norm(qk, None, eps * inv_scale**2)
    q, k = mx.split(normed, 2, axis=2)
    return (inv_scale**2) * q, inv_scale * k


@lru_cache
def _key_scale(dim: int) -> mx.array:
    """``Dk**-0.5`` for each of a key's ``Dk`` entries, float32: the weight of
    :func:`normalize_qk_heads`'s one-token norm (host data: a leaf even when
    first asked for inside a compiled trace)."""
    return mx.array(np.full(dim, dim**-0.5, np.float32))


@partial(mx.compile, shapeless=True)
def conv_taps(*views_then_taps: mx.array) -> mx.array:
    """A depthwise causal conv as its ``K`` taps: ``K`` shifted views of the
    padded input, then the ``K`` per-channel weights; ``sum_j x_j * w_j`` in
    float32 (as a conv accumulates), in the input's dtype. One fused kernel
    for every length, so no shape ever reaches a conv backend."""
    kernel = len(views_then_taps) // 2
    views, taps = views_then_taps[:kernel], views_then_taps[kernel:]
    out = sum(v.astype(mx.float32) * w.astype(mx.float32) for v, w in zip(views, taps, strict=True))
    return out.astype(views[0].dtype)


def padded_conv(padded: mx.array, weight: mx.array) -> mx.array:
    """The conv over *padded* ``(B, K - 1 + L, C)`` (a tail, then ``L`` new
    rows): ``(B, L, C)``, :func:`conv_taps` over its ``K`` shifted views."""
    kernel = weight.shape[1]
    length = padded.shape[1] - (kernel - 1)
    views = [padded[:, j : j + length] for j in range(kernel)]
    return conv_taps(*views, *(weight[:, j, 0] for j in range(kernel)))


def causal_conv_with_tail(
    x: mx.array, tail: mx.array | None, weight: mx.array, ends: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv1d over ``x`` (``(1, L, C)``) continuing from ``tail``.

    ``weight`` is mlx's conv layout ``(C, K, 1)``; ``tail`` holds the previous
    ``K - 1`` inputs (``None``: zeros, the sequence start). Returns the conv
    output ``(1, L, C)`` (no activation) and the new tail ``(1, K - 1, C)``,
    after a chunk copied so it does not keep the whole chunk's input alive;
    after one token a view (it keeps one row more alive, and a batch's
    strided tail would cost a copy kernel every step).

    The conv is :func:`conv_taps` (``K`` shifted views summed), not
    ``mx.conv1d``: it gives the same values, bit for bit in float32, and MLX's
    grouped ``conv1d`` is slow. On the CPU it ran 5-11x slower at prefill
    widths (``(1, 512, 8192)``: 205 against 18 ms); on CUDA it is a cuDNN
    call planned for its exact shape, and a server's prefill forwards see a
    new length almost every time, where the taps are one fused kernel for
    any length. In a compiled step the taps fuse with what follows (the SiLU).

    With *ends* ``(B,)``, row ``i``'s inputs past its first ``ends[i]`` are
    padding, and its new tail is the ``K - 1`` inputs before them.
    """
    channels, kernel, _ = weight.shape
    if tail is None:
        tail = mx.zeros((x.shape[0], kernel - 1, channels), dtype=x.dtype)
    padded = mx.concatenate([tail, x], axis=1)  # (1, K - 1 + L, C)
    if ends is not None:
        index = ends[:, None] + mx.arange(kernel - 1)[None]  # (B, K - 1)
        new_tail = mx.take_along_axis(padded, index[..., None], axis=1)
    else:
        new_tail = padded[:, padded.shape[1] - (kernel - 1) :]
    if x.shape[1] > 1:
        new_tail = mx.contiguous(new_tail)
    return padded_conv(padded, weight), new_tail


@partial(mx.compile, shapeless=True)
def gated_rms_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: float) -> mx.array:
    """RMSNorm over ``Dv`` then ``* silu(gate)`` in float32, one fused kernel
    after the norm, in the gate's dtype (the model's: ``z`` is a projection).

    The layer's readout ``x`` is float32 (the recurrence's; every
    ``gated_delta*`` returns it uncast) and so is the layer's *weight*
    (:func:`float32_norm_weight`): the norm reads both as they are and the
    gate's kernel casts once, where a cast of the readout to the model's
    dtype was a kernel of its own in every pass."""
    normed = mx.fast.rms_norm(x, weight, eps)
    return (nn.silu(gate.astype(mx.float32)) * normed.astype(mx.float32)).astype(gate.dtype)


def float32_norm_weight(mixer: nn.Module) -> mx.array:
    """*mixer*'s gated-norm weight in float32 (:func:`gated_rms_norm` reads a
    float32 readout), cast once per weight (:func:`derived`)."""
    weight = mixer["norm"]["weight"]
    return derived(mixer, "_norm_weight", weight, lambda w: w.astype(mx.float32))
