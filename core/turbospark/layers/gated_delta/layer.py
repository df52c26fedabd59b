"""The gated-DeltaNet mixer (:class:`GatedDeltaNet`, HF parameter names) and the passes that run it: plain, kernel, unrolled."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from turbospark.layers import fused
from turbospark.layers.cuda import gdn as gdn_cuda
from turbospark.layers.fused import runs_compiled
from turbospark.layers.gated_delta.gates import (
    causal_conv_with_tail,
    decay_rate,
    float32_norm_weight,
    gated_rms_norm,
    log_decay,
    mixer_input_bias,
    normalize_qk_heads,
    padded_conv,
)
from turbospark.layers.gated_delta.rule import (
    gated_delta,
    gated_delta_decode,
    gated_delta_traced,
    group_gates,
    traced_layer,
)
from turbospark.layers.gated_delta.state import GDNComponent
from turbospark.layers.stacked import Stacked, WeightT, gemm_add, matmul_t, project, stacked

IN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")  # stacked in this order

# -- the layer ------------------------------------------------------------------


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

    @classmethod
    def of(cls, arch: Any) -> GDNDims:
        """The sizes from a checkpoint config under the ``linear_*`` keys Qwen3.5
        writes (every gated-DeltaNet family's), so no family derives them itself."""
        return cls(
            hidden_size=arch.hidden_size,
            num_key_heads=arch.linear_num_key_heads,
            num_value_heads=arch.linear_num_value_heads,
            key_head_dim=arch.linear_key_head_dim,
            value_head_dim=arch.linear_value_head_dim,
            conv_kernel=arch.linear_conv_kernel_dim,
            eps=arch.rms_norm_eps,
        )

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
        sharded mixer's projections are sliced in place, still ``nn.Linear``; a
        quantized one's are ``nn.QuantizedLinear``, of one packing (as mlx-lm
        quantizes every linear layer alike) or several (read as
        :class:`~turbospark.layers.stacked.PerModule`)."""
        stack = stacked(self, IN_PROJECTIONS)
        if stack is None:
            raise TypeError(
                "a gated-DeltaNet's input projections must be plain nn.Linear or "
                "nn.QuantizedLinear layers, all with a bias or none; load them as such"
            )
        return stack

    def __call__(
        self, x: mx.array, state: GDNComponent, index: int, residual: mx.array | None = None
    ) -> mx.array:
        """``x`` ``(B, L, hidden)``; reads and replaces layer ``index`` of ``state``.
        With *residual*, returns ``residual`` plus the output, the add made by
        ``out_proj``'s GEMM (:func:`~turbospark.layers.stacked.project`).

        Everything is :func:`mix` (on CUDA :func:`mix_kernel`), compiled for
        decode (``L = 1``) and a lone row's short forward. A prefill group's
        forward whose shorter rows are padded (``state.valid``:
        :meth:`GDNComponent.pad`) takes :func:`mix` with their gates masked,
        on CUDA too: the kernel has no mask."""
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
        if state.valid is not None:  # a group's shorter rows padded: gated out
            out, tail, recurrent = mix(*args, valid=state.valid)
            state.set_layer(index, tail, recurrent)
        elif gdn_cuda.available():  # one kernel for the recurrence, at every length
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
    in_proj_t: WeightT,
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
    valid: mx.array | None = None,
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
    With *valid* ``(B,)``, row ``i``'s tokens past its first ``valid[i]`` are
    padding: their gates are those of no token at all (no decay, no write), so
    the state passes them unchanged, and the tail is the row's own last inputs.

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
    mixed, tail = causal_conv_with_tail(projected, tail, conv_weight, valid)
    # One token on a GPU (fused.builds_for_gpu): the forms with fewer kernels
    # (gated_delta_decode's docstring); the CPU keeps the reference's, cheaper there.
    gpu_step = length == 1 and not traced and valid is None and fused.builds_for_gpu()
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
        if valid is not None:
            real = (mx.arange(length)[None] < valid[:, None])[..., None]  # (B, L, 1)
            log_g, beta = mx.where(real, log_g, 0.0), mx.where(real, beta, 0.0)
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
    in_proj_t: WeightT,
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
    kernel (:func:`turbospark.layers.cuda.gdn.gated_delta`), for any number
    of tokens: the input projection, the conv and its SiLU, the kernel, the
    gated norm; a decode step (one token, not kept) is all one kernel after
    the GEMM (:func:`turbospark.layers.cuda.gdn.decode_mixer`). Returns the
    ``(B, L, value_dim)`` output, the new conv tail
    and the new state; with *keep* (a verify pass), the output, the conv's
    padded input ``(B, K - 1 + L, C)``, the state after the last token and
    after every token ``(B, L, Hv, Dv, Dk)``, which :func:`kept_layer` reads a
    layer's state from."""
    batch, length, _ = x.shape
    if length == 1 and not keep:  # a decode step: all of it but the GEMMs in one kernel
        out, recurrent, tail = gdn_cuda.decode_mixer(
            matmul_t(x, in_proj_t), tail, conv_weight, in_bias, rate, recurrent, norm_weight,
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
    in_proj_t: WeightT,
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
    rejection, and the host builds it no slower (GPU forms forced). Stepping
    costs two kernels a token:
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
