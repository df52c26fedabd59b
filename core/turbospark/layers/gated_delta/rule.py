"""The gated delta rule: per token, chunked (WY form), traced for verify passes, and its dispatcher."""

from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx
import numpy as np

from turbospark.layers import fused

CHUNK_SIZE = 64
# Tokens whose WY chunks are prepared at once (a multiple of CHUNK_SIZE). The
# preparation holds about 70 float32 values a token and value-head dim (a 32k
# prompt in one forward of a ~1B qwen_gdn: ~9 GB a layer), so a longer forward
# takes its tokens this many at a time; a prompt chunk of the usual size (512)
# is one group, as before.
GROUP_TOKENS = 512
# A verify pass's trace (mix(traced=True)): conv input, deltas, keys, decays, G_i.
Trace = tuple[mx.array, mx.array, mx.array, mx.array, mx.array]

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
    group_tokens: int | None = None,
) -> tuple[mx.array, mx.array]:
    """The recurrence over a prompt, chunk by chunk (WY form), carrying ``state``:
    :func:`gated_delta_wy` on *group_tokens* (None: :data:`GROUP_TOKENS`)
    tokens at a time (rounded up to whole chunks), so what a long forward
    holds at once is bounded by the group, not its length. The groups cut at
    chunk boundaries and each chunk's arithmetic is the same whichever group
    it is in, so the output is the same, bit for bit, as one group's
    (``tests/test_gated_delta_forms.py``)."""
    length = q.shape[1]
    tokens = GROUP_TOKENS if group_tokens is None else group_tokens
    group = max(1, tokens // chunk_size) * chunk_size
    if length <= group:
        return gated_delta_wy(q, k, v, log_g, beta, state, chunk_size)
    ys = []
    for begin in range(0, length, group):
        parts = [x[:, begin : begin + group] for x in (q, k, v, log_g, beta)]
        if ys:  # prepared once the group before is through: one group's arrays at a time
            parts = mx.depends(parts, [state])
        y, state = gated_delta_wy(*parts, state, chunk_size)
        ys.append(y)
    return mx.concatenate(ys, axis=1), state


def gated_delta_wy(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[mx.array, mx.array]:
    """The recurrence over *q*'s tokens, chunk by chunk (WY form), every chunk
    prepared at once, carrying ``state``.

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
