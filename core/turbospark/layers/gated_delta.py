"""Gated DeltaNet: the linear-attention layer of Qwen3.5-style hybrids, and its state.

Per value head the layer keeps a matrix ``S`` (``(Dv, Dk)``) and, per token,

    S_t = g_t * S_{t-1} + beta_t * (v_t - g_t * S_{t-1} k_t) k_t^T,      y_t = S_t q_t

(the *gated delta rule*: decay by ``g``, then one delta-rule step towards
``v_t`` along ``k_t``). Decode uses the step directly. Prefill uses the
chunkwise (WY) form of "Gated Delta Networks" (Yang et al., 2024): inside a
chunk the deltas solve a unit lower-triangular system, so a chunk of ``C``
tokens costs a few ``C x C`` and ``C x D`` matmuls and only the state carry
between chunks is sequential. A draft's verify pass is one such chunk that
also hands back its deltas, from which the state after any of its tokens is
one matmul, built only when drafts were rejected (:func:`gated_delta_traced`,
:func:`traced_layer`); on a GPU, where kernels cost more than arithmetic, a
short pass steps token by token instead and keeps every token's state
(:func:`mix_unrolled`). Every form computes in float32. On MLX's CUDA
backend every one of these is instead one kernel for the recurrence, its q/k
norm and gates (:mod:`turbospark.layers.gdn_cuda`, through :func:`mix_kernel`),
whatever the length; the forms above serve the CPU and Metal.

Shapes follow mlx-lm's ``gated_delta.py`` so checkpoints and states line up:
q/k ``(B, T, Hk, Dk)``, v ``(B, T, Hv, Dv)``, gates ``(B, T, Hv)``, state
``(B, Hv, Dv, Dk)`` float32. ``Hv`` must be a multiple of ``Hk`` (grouped heads).

Families import the pieces: :class:`GatedDeltaNet` (HF parameter names
``in_proj_qkv/z/b/a``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``,
``out_proj``), the functions it is built from, and :class:`GDNComponent`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from turbospark.layers import fused, gdn_cuda
from turbospark.layers.fused import runs_compiled
from turbospark.layers.stacked import Stacked, derived, gemm_add, project, stacked
from turbospark.state import Snapshot, refuse_rewind

CHUNK_SIZE = 64
# A verify pass's trace (mix(traced=True)): conv input, deltas, keys, decays, G_i.
Trace = tuple[mx.array, mx.array, mx.array, mx.array, mx.array]
IN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")  # stacked in this order


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


def mixer_input_bias(mixer: nn.Module, in_proj_t: mx.array) -> mx.array:
    """*mixer*'s :func:`input_bias` for its stacked projections *in_proj_t*, in
    their dtype (a float32 bias would promote the GEMM), built once per
    ``dt_bias`` (:func:`derived`)."""
    columns, dtype = in_proj_t.shape[1], in_proj_t.dtype
    return derived(
        mixer, "_input_bias", mixer["dt_bias"], lambda dt: input_bias(dt.astype(dtype), columns)
    )


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
    x: mx.array, tail: mx.array | None, weight: mx.array
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
    """
    channels, kernel, _ = weight.shape
    if tail is None:
        tail = mx.zeros((x.shape[0], kernel - 1, channels), dtype=x.dtype)
    padded = mx.concatenate([tail, x], axis=1)  # (1, K - 1 + L, C)
    new_tail = padded[:, padded.shape[1] - (kernel - 1) :]
    if x.shape[1] > 1:
        new_tail = mx.contiguous(new_tail)
    return padded_conv(padded, weight), new_tail


# -- the recurrence -------------------------------------------------------------


@mx.compile
def gated_delta_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token: q/k ``(B, Hv, Dk)``, v ``(B, Hv, Dv)``, g/beta ``(B, Hv)``,
    state ``(B, Hv, Dv, Dk)``; returns y ``(B, Hv, Dv)`` and the new state."""
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # (B, Hv, Dv): what S predicts for k
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)  # (B, Hv, Dv)
    return y, state


def gated_delta_sequential(
    q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """The recurrence token by token (decode, and the reference for the chunked form)."""
    q, k = _expand_heads(q, k, v.shape[2])
    g = mx.exp(log_g)
    ys = []
    for t in range(q.shape[1]):
        y, state = gated_delta_step(
            q[:, t].astype(mx.float32),
            k[:, t].astype(mx.float32),
            v[:, t].astype(mx.float32),
            g[:, t],
            beta[:, t].astype(mx.float32),
            state,
        )
        ys.append(y)
    return mx.stack(ys, axis=1), state


def gated_delta_decode(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array,
    by_matmul: bool | None = None,
) -> tuple[mx.array, mx.array]:
    """The step for one token (decode) in three kernels once compiled: the
    same recurrence as :func:`gated_delta_step`, rearranged.

    ``(g S) k = g (S k)``, so what the state predicts for ``k`` is one matmul
    of the old state; the decay and the delta-rule update are then one
    elementwise pass that writes the new state, and the readout ``S' q`` a
    second matmul. The step's form (decay, two products each a multiply and a
    reduction over ``Dk``) materialises the decayed state and each product:
    six kernels and four casts. Grouped heads are read in place: value heads
    ``j*r .. j*r + r - 1`` share key head ``j``, so the state viewed
    ``(B, Hk, r * Dv, Dk)`` multiplies the unrepeated keys and queries.

    :func:`mix` takes it for one token where
    :func:`~turbospark.layers.fused.builds_for_gpu` (the CPU keeps
    :func:`gated_delta_sequential`: there a small BLAS call or a broadcast
    pass costs more than the kernels saved). *by_matmul* (None: the same
    test): the two products as matmuls, else a multiply and a sum each.

    q/k ``(B, 1, Hk, Dk)``, v ``(B, 1, Hv, Dv)``, log_g/beta by key head and
    group, ``(B, Hk, r, 1, 1)`` (:func:`group_gates`: their elementwise chains
    then fuse into the update), state ``(B, Hv, Dv, Dk)`` float32; returns y
    ``(B, 1, Hv, Dv)`` and the new state, float32 (:func:`gated_rms_norm`)."""
    batch, _, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2:]
    group = value_heads // key_heads
    # (B, 1, Hk, Dk) -> (B, Hk, Dk, 1): the column each group's rows multiply.
    # Cast, then reshape: a compiled step fuses no elementwise op across a reshape.
    k = k.astype(mx.float32).reshape(batch, key_heads, key_dim, 1)
    q = q.astype(mx.float32).reshape(batch, key_heads, key_dim, 1)
    rows = (batch, key_heads, group * value_dim, key_dim)  # the state, by key head
    if by_matmul is None:
        by_matmul = fused.builds_for_gpu()

    def times(s: mx.array, x: mx.array) -> mx.array:  # (B, Hk, r * Dv, 1)
        return s @ x if by_matmul else (s * x.swapaxes(-1, -2)).sum(axis=-1, keepdims=True)

    predicted = times(state.reshape(rows), k)  # S k
    g = mx.exp(log_g)
    grouped = (batch, key_heads, group, value_dim, 1)
    delta = (v.reshape(grouped).astype(mx.float32) - g * predicted.reshape(grouped)) * beta.astype(
        mx.float32
    )
    # (B, Hk, r, Dv, Dk): decay, plus the delta along k (k broadcast over the group)
    state = g * state.reshape(*grouped[:4], key_dim) + delta * k.reshape(
        batch, key_heads, 1, 1, key_dim
    )
    y = times(state.reshape(rows), q)  # (B, Hk, r * Dv, 1)
    return (
        y.reshape(batch, 1, value_heads, value_dim),
        state.reshape(batch, value_heads, value_dim, key_dim),
    )


def group_gates(gate: mx.array, key_heads: int) -> mx.array:
    """``(B, 1, Hv)`` -> ``(B, Hk, r, 1, 1)``: one token's per-value-head gate
    (or its input), by key head and group, as :func:`gated_delta_decode` reads it."""
    batch, _, value_heads = gate.shape
    return gate.reshape(batch, key_heads, value_heads // key_heads, 1, 1)


@lru_cache
def _chunk_masks(c: int) -> tuple[mx.array, mx.array, mx.array]:
    """A chunk's constant masks, built on the host once per chunk size (leaves:
    no kernel in any pass, where ``mx.tril``/``mx.eye`` cost a GPU several a
    layer): on and below the diagonal, strictly below (bool ``(C, C)``), and
    the identity (float32)."""
    lower = np.tril(np.ones((c, c), dtype=bool))
    return mx.array(lower), mx.array(np.tril(lower, -1)), mx.array(np.eye(c, dtype=np.float32))


def _segment_sums(log_g: mx.array) -> mx.array:
    """``out[..., i, j] = sum(log_g[..., j+1 : i+1])`` for ``i >= j``, ``-inf`` above.

    Summing the segment directly (not ``cumsum[i] - cumsum[j]``) avoids the
    cancellation that would cost precision when decays are strong.
    """
    lower, strict, _ = _chunk_masks(log_g.shape[-1])
    rows = mx.where(strict, log_g[..., :, None], 0.0)  # (..., C, C): row i holds log_g[i]
    return mx.where(lower, mx.cumsum(rows, axis=-2), -mx.inf)


def _unit_lower_inverse(m: mx.array) -> mx.array:
    """``(I + M)^-1`` for strictly lower-triangular ``M`` (``(..., C, C)``).

    On the CPU, LAPACK's triangular inverse: exact and, measured there, ~40x
    faster than matmul doubling. MLX has no GPU kernel for it, and running it
    on the CPU stream from a GPU graph costs a sync per layer and chunk, so
    where the forms are a GPU's (:func:`~turbospark.layers.fused.builds_for_gpu`)
    the inverse is built by doubling instead (:func:`_doubling_inverse`).
    """
    if fused.builds_for_gpu():
        return _doubling_inverse(m)
    return mx.linalg.tri_inv(_chunk_masks(m.shape[-1])[2] + m, upper=False, stream=mx.cpu)


def _doubling_inverse(m: mx.array) -> mx.array:
    """``(I + M)^-1 = prod_j (I + (-M)^(2^j))`` for nilpotent ``M`` (``M^C = 0``):
    ``log2 C`` squarings and products, all batched matmuls, each product's
    sum in its GEMM (``addmm``)."""
    c = m.shape[-1]
    power = -m
    inverse = _chunk_masks(c)[2] + power
    span = 2
    while span < c:
        power = power @ power
        inverse = mx.addmm(inverse, inverse, power)
        span *= 2
    return inverse


@partial(mx.compile, shapeless=True)
def _strictly_lower(product: mx.array, decay: mx.array, strict: mx.array) -> mx.array:
    """``M``: a chunk's products times their decays, strictly below the diagonal, one kernel."""
    return mx.where(strict, product * decay, 0.0)


@mx.compile
def _chunk_carry(
    state: mx.array,
    w_and_q: mx.array,
    u: mx.array,
    attn: mx.array,
    k_to_end: mx.array,
    end_decay: mx.array,
) -> tuple[mx.array, mx.array]:
    """Apply one chunk to the carried state (``(B, Hv, Dv, Dk)``): outputs and new state.

    ``w_and_q`` stacks ``W`` and the decayed queries (``(B, Hv, 2C, Dk)``) so
    both read the start state in one matmul.
    """
    chunk = u.shape[-2]
    read = w_and_q @ mx.swapaxes(state, -1, -2)  # (B, Hv, 2C, Dv)
    deltas = u - read[..., :chunk, :]  # (B, Hv, C, Dv): the delta-rule updates u_i
    y = read[..., chunk:, :] + attn @ deltas  # (B, Hv, C, Dv)
    state = state * end_decay[..., None, None] + mx.swapaxes(deltas, -1, -2) @ k_to_end
    return y, state


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[mx.array, mx.array]:
    """The recurrence over a prompt, chunk by chunk (WY form), carrying ``state``.

    Within a chunk with decays ``G_i = prod_{m<=i} g_m`` and start state ``S0``,
    the deltas ``u_i = beta_i (v_i - g_i S_{i-1} k_i)`` satisfy
    ``(I + M) U = beta*V - (G*beta*K) S0^T`` with ``M_ij = beta_i (G_i/G_j) k_i.k_j``
    (``j < i``), so ``U = T beta V - T (G beta K) S0^T`` with ``T = (I + M)^-1``,
    computed for all chunks at once. Then ``Y = (G Q) S0^T + (Q K^T * G_i/G_j) U``
    and ``S_end = G_C S0 + U^T (K * G_C/G_j)``. Padding with ``beta = k = 0``,
    ``log g = 0`` leaves the state untouched, so odd lengths need no special case.
    """
    batch, length = q.shape[:2]
    hv, dv = v.shape[2:]
    q, k = _expand_heads(q, k, hv)
    chunks = -(-length // chunk_size)
    pad = chunks * chunk_size - length

    def blocks(x: mx.array) -> mx.array:
        # (B, T, Hv, ...) -> (B, Hv, chunks, C, ...), float32, zero-padded at the end
        x = x.astype(mx.float32)
        x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = mx.moveaxis(x, 2, 1)
        return x.reshape(batch, hv, chunks, chunk_size, *x.shape[3:])

    qc, kc, vc, gc, bc = (blocks(x) for x in (q, k, v, log_g, beta))
    decay = mx.exp(_segment_sums(gc))  # (B, Hv, n, C, C): G_i / G_j, 0 above the diagonal
    growth = mx.exp(mx.cumsum(gc, axis=-1))  # (B, Hv, n, C): G_i from the chunk start
    k_beta = kc * bc[..., None]
    strict = _chunk_masks(chunk_size)[1]
    m = _strictly_lower(k_beta @ mx.swapaxes(kc, -1, -2), decay, strict)
    t_inv = _unit_lower_inverse(m)
    u = t_inv @ (vc * bc[..., None])  # (B, Hv, n, C, Dv)
    w = t_inv @ (k_beta * growth[..., None])  # (B, Hv, n, C, Dk)
    attn = (qc @ mx.swapaxes(kc, -1, -2)) * decay  # (B, Hv, n, C, C), causal incl. diagonal
    w_and_q = mx.concatenate([w, qc * growth[..., None]], axis=-2)  # (B, Hv, n, 2C, Dk)
    # The last row of the decays is unmasked: G_C / G_j for every j.
    k_to_end = kc * decay[..., -1, :, None]  # k_j * G_C / G_j
    end_decay = growth[..., -1]  # (B, Hv, n)

    ys = []
    for c in range(chunks):
        y, state = _chunk_carry(
            state,
            w_and_q[:, :, c],
            u[:, :, c],
            attn[:, :, c],
            k_to_end[:, :, c],
            end_decay[:, :, c],
        )
        ys.append(y)
    y = mx.stack(ys, axis=2).reshape(batch, hv, chunks * chunk_size, dv)
    y = mx.moveaxis(y, 1, 2)[:, :length]  # (B, T, Hv, Dv)
    return y, state


@lru_cache
def _traced_sums(length: int) -> np.ndarray:
    """``(L, L*L + L)`` 0/1: ``log_g @ it`` gives every segment sum
    ``sum(log_g[j+1 : i+1])`` (``(L, L)`` flattened, 0 above the diagonal), then
    every cumulative sum ``sum(log_g[: i+1])``: one exact matmul instead of
    cumulative sums, masks and selects (kernels a launch-bound step pays for)."""
    i, j, m = np.meshgrid(*[np.arange(length)] * 3, indexing="ij")
    segments = ((j < m) & (m <= i)).reshape(length * length, length)
    prefixes = np.tril(np.ones((length, length), dtype=bool))
    return np.concatenate([segments, prefixes]).T.astype(np.float32)


def gated_delta_traced(
    q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array, tuple[mx.array, mx.array, mx.array, mx.array]]:
    """A verify pass (``L`` tokens, a few): the output, the state after the last
    token, and what the state after any earlier token is rebuilt from
    (:func:`traced_state`) if drafts are rejected.

    The WY form of :func:`gated_delta_chunked` for one chunk, written for the
    fewest kernels (about 24 whatever ``L`` up to 8, against about 7 a token
    stepping token by token, which is what a launch-bound GPU pays for): the
    segment and prefix sums of the log decays are one matmul with a constant
    (:func:`_traced_sums`), the inverse is :func:`_doubling_inverse` (its
    products fused with their sums, ``addmm``) on every device, and each read
    of the start state ``S0`` is one ``addmm``. The trace is ``(deltas, keys,
    decays G_i / G_j (0 above the diagonal), G_i)``, ``(B, Hv, L, Dv)``,
    ``(B, Hv, L, Dk)``, ``(B, Hv, L, L)``, ``(B, Hv, L)``, all float32, the decays
    exponentiated once for the pass and any state rebuilt: with ``G_n`` the decay over
    the first ``n`` tokens, ``S_n = G_n S0 + sum_{j<n} (G_n / G_j) u_j k_j^T``."""
    length = q.shape[1]
    q, k = _expand_heads(q, k, v.shape[2])
    # (B, L, Hv, ...) -> (B, Hv, L, ...), float32
    qc, kc, vc, gc, bc = (mx.moveaxis(x.astype(mx.float32), 2, 1) for x in (q, k, v, log_g, beta))
    sums = gc @ mx.array(_traced_sums(length))  # (B, Hv, L*L + L)
    seg = sums[..., : length * length].reshape(*gc.shape, length)  # (B, Hv, L, L)
    cum = sums[..., length * length :]  # (B, Hv, L): log G_i
    lower, strict, _ = _chunk_masks(length)
    decay = mx.where(lower, mx.exp(seg), 0.0)  # G_i / G_j on and below the diagonal
    k_beta = kc * bc[..., None]
    inverse = _doubling_inverse(_strictly_lower(k_beta @ mx.swapaxes(kc, -1, -2), decay, strict))
    growth = mx.exp(cum)  # (B, Hv, L): G_i
    u = inverse @ (vc * bc[..., None])  # (B, Hv, L, Dv)
    w = inverse @ (k_beta * growth[..., None])  # (B, Hv, L, Dk)
    s0_t = mx.swapaxes(state, -1, -2)  # (B, Hv, Dk, Dv)
    deltas = mx.addmm(u, w, s0_t, alpha=-1.0)  # (B, Hv, L, Dv): the delta-rule updates
    attn = (qc @ mx.swapaxes(kc, -1, -2)) * decay  # (B, Hv, L, L), causal incl. diagonal
    y = mx.addmm((qc * growth[..., None]) @ s0_t, attn, deltas)  # (B, Hv, L, Dv)
    # The decays as computed above: a state after n tokens exponentiates nothing again.
    trace = (deltas, kc, decay, growth)
    return mx.moveaxis(y, 1, 2), traced_state(state, trace, length), trace


def traced_state(
    start: mx.array, trace: tuple[mx.array, mx.array, mx.array, mx.array], n: int
) -> mx.array:
    """The recurrent state after the first *n* (1 or more) tokens of a traced
    pass that began at *start*; see :func:`gated_delta_traced`."""
    deltas, keys, decay, growth = trace
    # row n - 1 up to column n - 1 is on or below the diagonal: G_n / G_j, unmasked
    to_n = keys[..., :n, :] * decay[..., n - 1, :n][..., None]  # k_j * G_n / G_j
    start = start * growth[..., n - 1][..., None, None]
    return mx.addmm(start, mx.swapaxes(deltas[..., :n, :], -1, -2), to_n)  # (B, Hv, Dv, Dk)


def traced_layer(
    tail: mx.array, recurrent: mx.array, trace: Trace, n: int
) -> tuple[mx.array, mx.array]:
    """A layer's ``(conv tail, state)`` after the first *n* (1 or more) tokens of
    a traced pass that began at ``(tail, recurrent)``; *trace* is what
    :func:`mix` hands back from it: the conv input ``(B, L, C)``, then the
    recurrence's trace (:func:`gated_delta_traced`)."""
    projected, *recurrence = trace
    padded = mx.concatenate([tail, projected], axis=1)  # (B, K - 1 + L, C)
    return (
        mx.contiguous(padded[:, n : n + tail.shape[1]]),
        traced_state(recurrent, tuple(recurrence), n),  # type: ignore[arg-type]
    )


def gated_delta(
    q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """The step for a single token, the chunked form for anything longer."""
    if q.shape[1] == 1:
        return gated_delta_sequential(q, k, v, log_g, beta, state)
    return gated_delta_chunked(q, k, v, log_g, beta, state)


def _expand_heads(q: mx.array, k: mx.array, value_heads: int) -> tuple[mx.array, mx.array]:
    """Grouped heads: value head ``h`` reads key head ``h // (Hv // Hk)``."""
    repeat = value_heads // q.shape[2]
    if repeat > 1:
        q = mx.repeat(q, repeat, axis=2)
        k = mx.repeat(k, repeat, axis=2)
    return q, k


# -- the layer ------------------------------------------------------------------


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


class RMSNormGated(nn.Module):
    """RMSNorm over ``Dv`` then ``* silu(z)`` in float32 (the output gate)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return gated_rms_norm(x, gate, self.weight, self.eps)


@dataclass(frozen=True)
class GDNDims:
    """The sizes of one gated-DeltaNet layer (HF ``linear_*`` config keys)."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    eps: float

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer: projections, causal conv, gated delta rule, gated norm."""

    def __init__(self, dims: GDNDims):
        super().__init__()
        if dims.num_value_heads % dims.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({dims.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({dims.num_key_heads})"
            )
        self.dims = dims
        self.in_proj_qkv = nn.Linear(dims.hidden_size, dims.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dims.hidden_size, dims.value_dim, bias=False)
        self.in_proj_b = nn.Linear(dims.hidden_size, dims.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(dims.hidden_size, dims.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(
            dims.conv_dim, dims.conv_dim, dims.conv_kernel, groups=dims.conv_dim, bias=False
        )
        self.A_log = mx.zeros((dims.num_value_heads,))
        self.dt_bias = mx.ones((dims.num_value_heads,))
        self.norm = RMSNormGated(dims.value_head_dim, dims.eps)
        self.out_proj = nn.Linear(dims.value_dim, dims.hidden_size, bias=False)

    def in_projections(self) -> Stacked:
        """``in_proj_qkv/z/a/b`` as one weight, in that order (one matmul). A
        sharded mixer's projections are sliced in place, still ``nn.Linear``."""
        stack = stacked(self, IN_PROJECTIONS)
        if stack is None:
            raise TypeError("a gated-DeltaNet's input projections must be plain nn.Linear layers")
        return stack

    def __call__(
        self, x: mx.array, state: GDNComponent, index: int, residual: mx.array | None = None
    ) -> mx.array:
        """``x`` ``(B, L, hidden)``; reads and replaces layer ``index`` of ``state``.
        With *residual*, returns ``residual`` plus the output, the add made by
        ``out_proj``'s GEMM (:func:`~turbospark.layers.stacked.project`).

        Everything is :func:`mix` (on CUDA :func:`mix_kernel`), compiled for
        decode (``L = 1``) and a lone row's short forward."""
        d = self.dims
        batch, length, _ = x.shape
        tail, recurrent = state.layer(index)
        if tail is None:
            tail = mx.zeros((batch, d.conv_kernel - 1, d.conv_dim), dtype=x.dtype)
        if recurrent is None:
            recurrent = mx.zeros(
                (batch, d.num_value_heads, d.value_head_dim, d.key_head_dim), dtype=mx.float32
            )
        # Arrays by item (a module is a dict): nn.Module.__getattr__ is a Python
        # call, and this runs for every linear layer and step.
        projections = self.in_projections()
        args = (
            x,
            projections.weight_t,
            tail,
            recurrent,
            self["conv1d"]["weight"],
            decay_rate(self),
            mixer_input_bias(self, projections.weight_t),
            float32_norm_weight(self),
            d.num_key_heads,
            d.num_value_heads,
            d.key_head_dim,
            d.value_head_dim,
            d.eps,
        )
        if gdn_cuda.available():  # one kernel for the recurrence, at every length
            compiled = runs_compiled(batch, length)
            if state.tracing:  # a verify pass: the kernel keeps every token's state
                out, *kept = (mix_kernel_traced if compiled else mix_kernel_keeping)(*args)
                layer = partial(kept_layer, *kept)
                state.set_layer_traced(index, *layer(length), layer)
            else:
                out, tail, recurrent = (mix_kernel_step if compiled else mix_kernel)(*args)
                state.set_layer(index, tail, recurrent)
        elif state.tracing and fused.builds_for_gpu() and runs_compiled(batch, length):
            # A GPU's short traced pass: every token's state computed by stepping.
            out, padded, *states = mix_unrolled_step(*args)
            layer = partial(unrolled_layer, padded, states, recurrent.shape)
            state.set_layer_traced(index, *layer(length), layer)
        elif state.tracing:  # a verify pass: every token's state is kept
            traced = mix_traced if runs_compiled(batch, length) else partial(mix, traced=True)
            out, new_tail, new_recurrent, trace = traced(*args)
            # The state after an earlier token is built only if asked (drafts rejected).
            state.set_layer_traced(
                index, new_tail, new_recurrent, partial(traced_layer, tail, recurrent, trace)
            )
        else:
            out, tail, recurrent = (mix_step if length == 1 else mix)(*args)
            state.set_layer(index, tail, recurrent)
        # The module, not its weight: a sharded out_proj sums the ranks' parts.
        return project(self["out_proj"], out, residual)


def mix(
    x: mx.array,
    in_proj_t: mx.array,
    tail: mx.array,
    recurrent: mx.array,
    conv_weight: mx.array,
    rate: mx.array,
    in_bias: mx.array,
    norm_weight: mx.array,
    key_heads: int,
    value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    eps: float,
    traced: bool = False,
) -> tuple[mx.array, ...]:
    """The layer on ``x`` ``(B, L, hidden)`` up to its output projection: the
    input projections (*in_proj_t*: the transpose of ``in_proj_qkv/z/a/b``'s
    rows stacked, one GEMM with *in_bias*, :func:`input_bias`; ``nn.Linear`` is
    ``x @ w.T``), causal conv continuing from *tail*, SiLU, l2-normalised q/k,
    gates, the gated delta rule from *recurrent* and the gated norm. Returns
    the ``(B, L, value_dim)`` output (``out_proj`` is the caller's, so a sharded
    one can sum the ranks' parts), the new tail and the new state; *traced*
    (a draft's verify pass), also the :data:`Trace` that
    :func:`traced_layer` rebuilds the state after any of its tokens from.

    A pure function of arrays and sizes, so :data:`mix_step` can compile it."""
    batch, length, _ = x.shape
    key_dim = key_heads * key_head_dim
    value_dim = value_heads * value_head_dim
    conv_dim = 2 * key_dim + value_dim
    # (B, L, conv_dim + value_dim + 2 * Hv) -> qkv | z | a | b
    projected, z, a, b = mx.split(
        gemm_add(in_bias, x, in_proj_t),
        [conv_dim, conv_dim + value_dim, conv_dim + value_dim + value_heads],
        axis=-1,
    )
    mixed, tail = causal_conv_with_tail(projected, tail, conv_weight)
    # One token on a GPU (fused.builds_for_gpu): the forms with fewer kernels
    # (gated_delta_decode's docstring); the CPU keeps the reference's, cheaper there.
    gpu_step = length == 1 and not traced and fused.builds_for_gpu()
    # float32 out of the conv's own kernel, as the one-token norm and update read it
    mixed = nn.silu(mixed.astype(mx.float32) if gpu_step else mixed)
    qk, v = mx.split(mixed, [2 * key_dim], axis=-1)
    # (B, L, 2 * key_dim) -> q's heads then k's, normalised in one kernel
    qk = qk.reshape(batch, length, 2 * key_heads, key_head_dim)
    v = v.reshape(batch, length, value_heads, value_head_dim)
    q, k = normalize_qk_heads(qk, as_keys=gpu_step)
    if traced:
        log_g, beta = log_decay(rate, a), mx.sigmoid(b)  # (B, L, Hv)
        out, recurrent, recurrence = gated_delta_traced(q, k, v, log_g, beta, recurrent)
    elif gpu_step:
        # The gates' inputs grouped first (views), so their chains fuse into the update.
        a, b = group_gates(a, key_heads), group_gates(b, key_heads)
        per_head = (key_heads, value_heads // key_heads, 1, 1)
        log_g = log_decay(rate.reshape(per_head), a)
        out, recurrent = gated_delta_decode(q, k, v, log_g, mx.sigmoid(b), recurrent)
    else:
        log_g, beta = log_decay(rate, a), mx.sigmoid(b)  # (B, L, Hv)
        out, recurrent = gated_delta(q, k, v, log_g, beta, recurrent)
    z = z.reshape(batch, length, value_heads, value_head_dim)
    if gpu_step:  # q was scaled as keys are: the readout is Dk**0.5 too large
        eps = eps * key_head_dim  # RMSNorm(c y, eps) = RMSNorm(y, eps / c**2), c = Dk**-0.5
    out = gated_rms_norm(out, z, norm_weight, eps)  # (B, L, Hv, Dv)
    out = out.reshape(batch, length, value_heads * value_head_dim)
    if traced:
        return out, tail, recurrent, (projected, *recurrence)
    return out, tail, recurrent


def mix_kernel(
    x: mx.array,
    in_proj_t: mx.array,
    tail: mx.array,
    recurrent: mx.array,
    conv_weight: mx.array,
    rate: mx.array,
    in_bias: mx.array,
    norm_weight: mx.array,
    key_heads: int,
    value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    eps: float,
    keep: bool = False,
) -> tuple[mx.array, ...]:
    """:func:`mix` with the recurrence, the q/k norm and the gates as one CUDA
    kernel (:func:`turbospark.layers.gdn_cuda.gated_delta`), for any number
    of tokens: the input projection, the conv and its SiLU, the kernel, the
    gated norm; a decode step (one token, not kept) is all one kernel after
    the GEMM (:func:`turbospark.layers.gdn_cuda.decode_mixer`). Returns the
    ``(B, L, value_dim)`` output, the new conv tail
    and the new state; with *keep* (a verify pass), the output, the conv's
    padded input ``(B, K - 1 + L, C)``, the state after the last token and
    after every token ``(B, L, Hv, Dv, Dk)``, which :func:`kept_layer` reads a
    layer's state from."""
    batch, length, _ = x.shape
    if length == 1 and not keep:  # a decode step: all of it but the GEMMs in one kernel
        out, recurrent, tail = gdn_cuda.decode_mixer(
            x @ in_proj_t, tail, conv_weight, in_bias, rate, recurrent, norm_weight,
            key_heads, value_heads, key_head_dim, value_head_dim, eps,
        )  # fmt: skip
        return out, tail, recurrent
    key_dim = key_heads * key_head_dim
    value_dim = value_heads * value_head_dim
    conv_dim = 2 * key_dim + value_dim
    proj = gemm_add(in_bias, x, in_proj_t)  # qkv | z | a | b; the kernel reads a, b in place
    projected, z = proj[..., :conv_dim], proj[..., conv_dim : conv_dim + value_dim]
    if keep:
        padded = mx.concatenate([tail, projected], axis=1)  # (B, K - 1 + L, C)
        conv = padded_conv(padded, conv_weight)
    else:
        conv, tail = causal_conv_with_tail(projected, tail, conv_weight)
    mixed = nn.silu(conv.astype(mx.float32))  # (B, L, conv_dim): q | k | v
    out, recurrent, *states = gdn_cuda.gated_delta(
        mixed,
        proj,
        rate,
        recurrent,
        key_heads,
        value_heads,
        key_head_dim,
        value_head_dim,
        conv_dim + value_dim,
        keep,
    )
    z = z.reshape(batch, length, value_heads, value_head_dim)
    out = gated_rms_norm(out, z, norm_weight, eps).reshape(batch, length, value_dim)
    return (out, padded, recurrent, *states) if keep else (out, tail, recurrent)


def kept_layer(
    padded: mx.array, last: mx.array, states: mx.array, n: int
) -> tuple[mx.array, mx.array]:
    """A layer's ``(conv tail, state)`` after the first *n* (1 or more) tokens of
    a :func:`mix_kernel` pass that kept every token's state: the tail a view of
    the padded input (a few rows, as a decode step's tail is), the state the
    pass's *last* or a copy out of *states*, so a session never holds the
    pass's every state for one of them."""
    width = padded.shape[1] - states.shape[1]  # K - 1
    state = last if n == states.shape[1] else mx.contiguous(states[:, n - 1])
    return padded[:, n : n + width], state


def mix_unrolled(
    x: mx.array,
    in_proj_t: mx.array,
    tail: mx.array,
    recurrent: mx.array,
    conv_weight: mx.array,
    rate: mx.array,
    in_bias: mx.array,
    norm_weight: mx.array,
    key_heads: int,
    value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    eps: float,
) -> tuple[mx.array, ...]:
    """A short traced pass of a lone row on a GPU (a draft's verify pass):
    :func:`mix`'s one-token GPU forms, token after token, in
    one compiled function (:data:`mix_unrolled_step`).

    On a launch-bound GPU the WY chunk (:func:`gated_delta_traced`) costs
    :func:`mix` 35 kernels a layer for 2 tokens and 40 for 5 (13 for a decode
    step), and its trace a matmul a layer more when drafts are rejected; this
    form costs 16 and 22 (``bench/gpu_kernels.py``) and nothing on a
    rejection, and the host builds it no slower (GPU forms forced). Stepping costs two kernels a token:
    the update that writes ``S_t`` (:func:`gated_delta_decode`'s), and one
    matmul that reads ``S_t`` for both the readout ``S_t q_t`` and what it
    predicts for the next key, ``S_t k_{t+1}`` (``q_t`` beside ``k_{t+1}``:
    one stack for the pass). Every ``S_t`` is materialised anyway, so the
    state after any token is already there for a rollback, with nothing to
    rebuild. The conv is :func:`padded_conv` (no tail copy), both
    gates are one kernel, and q is scaled as k with the gated norm's eps
    absorbing it, as in the one-token step.

    Returns the ``(B, L, value_dim)`` output, the conv's padded input ``(B,
    K - 1 + L, C)`` (the tail after ``n`` tokens is its rows ``n .. n + K -
    2``), then the state after each token, ``(B, 1, Hk, r * Dv, Dk)``
    (:func:`unrolled_layer` takes them as a layer's state)."""
    batch, length, _ = x.shape
    key_dim = key_heads * key_head_dim
    value_dim = value_heads * value_head_dim
    conv_dim = 2 * key_dim + value_dim
    group = value_heads // key_heads
    # (B, L, conv_dim + value_dim + 2 * Hv) -> qkv | z | a | b
    projected, z, ab = mx.split(
        gemm_add(in_bias, x, in_proj_t), [conv_dim, conv_dim + value_dim], axis=-1
    )
    padded = mx.concatenate([tail, projected], axis=1)  # (B, K - 1 + L, C)
    mixed = nn.silu(padded_conv(padded, conv_weight).astype(mx.float32))
    qk, v = mx.split(mixed, [2 * key_dim], axis=-1)
    # (B, L, 2 * key_dim) -> q's heads then k's; each (B, L, Hk, Dk) float32
    q, k = normalize_qk_heads(qk.reshape(batch, length, 2 * key_heads, key_head_dim), as_keys=True)
    # Every per-token operand is a slice with its token axis kept (size 1), and
    # the state is by key head, (B, 1, Hk, r * Dv, Dk), so no token reshapes
    # anything: every node costs host time to build. (mx.split into the tokens
    # would be one node, but costs more to build than the slices it replaces.)
    rows = group * value_head_dim
    # Both gates in one kernel, float32, already repeated over Dv (so they
    # broadcast over the state's rows): a | b (B, L, 2 * Hv) -> (B, 2L, Hk, r * Dv, 1),
    # position 2t token t's decay, 2t + 1 its beta.
    ab = ab.reshape(batch, length, 2, key_heads, group, 1, 1)
    per_head = (key_heads, group, 1, 1)
    decay = mx.exp(log_decay(rate.reshape(per_head), ab))
    first = mx.array([True, False]).reshape(2, 1, 1, 1, 1)
    gates = mx.where(first, decay, mx.sigmoid(ab).astype(mx.float32))
    gates = mx.broadcast_to(gates, (*gates.shape[:-2], value_head_dim, 1)) + 0.0
    gates = gates.reshape(batch, 2 * length, key_heads, rows, 1)
    v = v.reshape(batch, length, key_heads, rows, 1)
    k_rows = k.reshape(batch, length, key_heads, 1, key_head_dim)
    if length > 1:  # (B, L - 1, Hk, Dk, 2): q_t beside k_{t+1}, what S_t multiplies
        columns = mx.stack([q[:, :-1], k[:, 1:]], axis=-1)
    state = recurrent.reshape(batch, 1, key_heads, rows, key_head_dim)
    predicted = state @ k[:, :1].reshape(batch, 1, key_heads, key_head_dim, 1)
    states, ys = [], []
    for t in range(length):
        g, beta = gates[:, 2 * t : 2 * t + 1], gates[:, 2 * t + 1 : 2 * t + 2]
        delta = (v[:, t : t + 1].astype(mx.float32) - g * predicted) * beta
        # decay, plus the delta along k_t: (B, 1, Hk, r * Dv, Dk)
        state = g * state + delta * k_rows[:, t : t + 1]
        states.append(state)
        if t + 1 < length:
            both = state @ columns[:, t : t + 1]  # (B, 1, Hk, r * Dv, 2)
            y, predicted = both[..., :1], both[..., 1:]
        else:
            y = state @ q[:, -1:].reshape(batch, 1, key_heads, key_head_dim, 1)
        ys.append(y)
    # (B, L, Hk, r * Dv, 1) -> (B, L, Hv, Dv)
    out = mx.concatenate(ys, axis=1).reshape(batch, length, value_heads, value_head_dim)
    z = z.reshape(batch, length, value_heads, value_head_dim)
    # q was scaled as keys are: the readout is Dk**0.5 too large (see normalize_qk_heads)
    out = gated_rms_norm(out, z, norm_weight, eps * key_head_dim)
    return out.reshape(batch, length, value_dim), padded, *states


def unrolled_layer(
    padded: mx.array, states: list[mx.array], shape: tuple[int, ...], n: int
) -> tuple[mx.array, mx.array]:
    """A layer's ``(conv tail, state)`` after the first *n* (1 or more) tokens
    of a :func:`mix_unrolled` pass: views of what the pass computed (the tail
    keeps the pass's few padded rows alive, as a decode step's does; the
    state ``(B, 1, Hk, r * Dv, Dk)`` back to the layer's *shape*, ``(B, Hv, Dv, Dk)``)."""
    width = padded.shape[1] - len(states)  # K - 1
    return padded[:, n : n + width], states[n - 1].reshape(shape)


# One token per row: no Python loop and no CPU-stream inverse, so the whole of
# :func:`mix` compiles; MLX traces it once per batch size and dtype.
mix_step = mx.compile(mix)
# A short traced pass of a lone row on a GPU, token by token (fused.builds_for_gpu).
mix_unrolled_step = mx.compile(mix_unrolled)
# A verify pass (a lone row, ``k + 1`` tokens): one WY chunk and its trace.
mix_traced = mx.compile(partial(mix, traced=True))
# The kernel's forms (gdn_cuda.available()): every decode step and a lone row's
# short forward compiled, as above; a verify pass keeps every token's state.
mix_kernel_step = mx.compile(mix_kernel)
mix_kernel_keeping = partial(mix_kernel, keep=True)
mix_kernel_traced = mx.compile(mix_kernel_keeping)


# -- the state ------------------------------------------------------------------

# A traced layer's state after its first n tokens (traced_layer, bound to the pass).
Rebuild = Callable[[int], tuple[mx.array, mx.array]]


@dataclass
class TracedPass:
    """A traced forward (a verify pass): where it started, how many tokens it
    fed, and per layer the ``(tail, recurrent)`` before it and the
    :data:`Rebuild` of its state after its first n tokens."""

    start: int
    layers: list[tuple[tuple[mx.array | None, mx.array | None], Rebuild] | None]
    length: int = 0


class GDNComponent:
    """Per linear layer: the conv tail ``(1, K-1, conv_dim)`` and the float32
    recurrent matrix ``(1, Hv, Dv, Dk)``.

    Arrays are replaced on every forward, never written in place, so a
    snapshot is a set of held references. Not rewindable: the decay and the
    delta-rule projection cannot be inverted, so dropping tokens means
    restoring a snapshot (or prefilling again). A fresh layer holds ``None``
    (zeros, allocated on first use), which keeps ``nbytes`` honest.

    Traceable: after :meth:`trace`, the next forward keeps every token's state,
    and :meth:`keep_traced` takes the one at the last accepted draft token.
    """

    name = "gdn"

    def __init__(self, num_layers: int):
        self._tails: list[mx.array | None] = [None] * num_layers
        self._states: list[mx.array | None] = [None] * num_layers
        self._position = 0
        self.tracing = False  # the next forward keeps every token's state (trace())
        self._traced: TracedPass | None = None  # the last traced forward's

    def layer(self, index: int) -> tuple[mx.array | None, mx.array | None]:
        return self._tails[index], self._states[index]

    def set_layer(self, index: int, tail: mx.array, recurrent: mx.array) -> None:
        self._tails[index] = tail
        self._states[index] = recurrent

    def set_layer_traced(
        self, index: int, tail: mx.array, recurrent: mx.array, rebuild: Rebuild
    ) -> None:
        """A traced forward's layer *index*: its state after the last token, and
        *rebuild* (n -> its state after the first n tokens, 1 or more)."""
        assert self._traced is not None, "set_layer_traced outside a traced forward"
        self._traced.layers[index] = (self.layer(index), rebuild)
        self.set_layer(index, tail, recurrent)

    def advance(self, n: int) -> None:
        """Called by the family once per forward, after every layer has run."""
        self._position += n
        if self.tracing:
            assert self._traced is not None
            self._traced.length, self.tracing = n, False

    # -- speculative rollback (turbospark.speculative) -----------------------------

    def trace(self) -> None:
        """Keep the state after every token of the next forward (a verify pass)."""
        self.tracing = True
        self._traced = TracedPass(self._position, [None] * len(self._tails))

    def held_trace(self) -> TracedPass | None:
        """The last traced forward, for a :meth:`keep_traced` after later
        forwards (a chained round queued before this one was read)."""
        return self._traced

    def keep_traced(self, n: int, held: object | None = None) -> None:
        """Become the state after the first *n* tokens of the last traced forward,
        or of *held* (:meth:`held_trace`; anything fed after it leaves too); the
        trace is dropped. The last one kept whole: nothing to do (the state is
        current); none: the held references from before it; otherwise each
        layer's state there is built from the trace (one matmul, lazily)."""
        traced = self._traced if held is None else held
        assert traced is None or isinstance(traced, TracedPass)
        current = traced is self._traced
        self._traced = None
        if traced is None or not 0 <= n <= traced.length:
            length = 0 if traced is None else traced.length
            raise refuse_rewind(self.name, length - n, length)
        if not (current and n == traced.length):
            for i, layer in enumerate(traced.layers):
                assert layer is not None, f"layer {i} ran no traced forward"
                before, rebuild = layer
                self._tails[i], self._states[i] = before if n == 0 else rebuild(n)
        self._position = traced.start + n

    @property
    def position(self) -> int:
        return self._position

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    @property
    def max_safe_rewind(self) -> int:
        return 0

    def reset(self) -> None:
        self._tails = [None] * len(self._tails)
        self._states = [None] * len(self._states)
        self._position = 0
        self.tracing, self._traced = False, None

    def rewind(self, n: int) -> None:
        if n != 0:
            raise refuse_rewind(self.name, n, 0)

    def arrays(self) -> list[mx.array]:
        return [
            a for pair in zip(self._tails, self._states, strict=True) for a in pair if a is not None
        ]

    def snapshot(self) -> Snapshot:
        snap: Snapshot = {"position": mx.array(self._position)}
        for i, (tail, recurrent) in enumerate(zip(self._tails, self._states, strict=True)):
            if tail is not None:
                snap[f"{i}.conv_tail"] = tail
                snap[f"{i}.recurrent"] = recurrent
        return snap

    # -- batching: the rows of several sessions are simply concatenated ----------

    @classmethod
    def merge(cls, parts: list[GDNComponent]) -> GDNComponent:
        """Several sessions' layers stacked along the batch axis. A session that
        has not run yet (a fresh prompt prefilled beside others) holds None: it
        stacks as zeros, which is what the layer reads None as."""
        merged = cls(len(parts[0]._tails))
        for i in range(len(merged._tails)):
            merged._tails[i] = _stack([p._tails[i] for p in parts])
            merged._states[i] = _stack([p._states[i] for p in parts])
        return merged

    def extend(self, other: GDNComponent) -> None:
        for i in range(len(self._tails)):
            self._tails[i] = mx.concatenate([self._tails[i], other._tails[i]], axis=0)
            self._states[i] = mx.concatenate([self._states[i], other._states[i]], axis=0)

    def filter(self, rows: list[int]) -> None:
        index = mx.array(rows)
        self._tails = [None if tail is None else tail[index] for tail in self._tails]
        self._states = [None if state is None else state[index] for state in self._states]

    def prepare(self, length: int) -> None:
        del length  # every step replaces the arrays: nothing to make room for

    def hold(self) -> object:
        return list(self._tails), list(self._states)

    def rollback(self, held: object) -> None:
        assert isinstance(held, tuple)
        self._tails, self._states = list(held[0]), list(held[1])

    def extract(self, row: int, position: int, back: int, held: object | None) -> GDNComponent:
        """Row *row* on its own; going *back* reads the references *held* before the step."""
        if back:
            assert isinstance(held, tuple), "a row going back needs the references held"
            tails, states = held
        else:
            tails, states = self._tails, self._states
        one = GDNComponent(len(self._tails))
        one._tails = [None if t is None else mx.contiguous(t[row : row + 1]) for t in tails]
        one._states = [None if s is None else mx.contiguous(s[row : row + 1]) for s in states]
        one._position = position
        return one

    def restore(self, snapshot: Snapshot) -> None:
        self.tracing, self._traced = False, None
        self._tails = [snapshot.get(f"{i}.conv_tail") for i in range(len(self._tails))]
        self._states = [snapshot.get(f"{i}.recurrent") for i in range(len(self._states))]
        self._position = int(snapshot["position"].item())


def _stack(parts: list[mx.array | None]) -> mx.array | None:
    """One-row arrays along the batch axis, None (all fresh) or zeros standing in
    for the fresh ones."""
    shaped = next((part for part in parts if part is not None), None)
    if shaped is None:
        return None
    return mx.concatenate([mx.zeros_like(shaped) if p is None else p for p in parts], axis=0)
