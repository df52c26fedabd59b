"""The chunked (WY) gated delta rule against the plain token-by-token recurrence.

Random unit-norm keys, grouped heads (4 value heads over 2 key heads), key
and value dims that differ, a non-zero start state and per-head decays from
barely-forgetting to forgetting within a token: outputs and final state must
agree to float32 precision at every length around the chunk boundaries.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from turbospark.layers import fused
from turbospark.layers.gated_delta.gates import (
    causal_conv_with_tail,
    decay_rate,
    input_bias,
    log_decay,
    mixer_input_bias,
    normalize_qk,
)
from turbospark.layers.gated_delta.layer import mix, mix_unrolled, unrolled_layer
from turbospark.layers.gated_delta.rule import (
    gated_delta_chunked,
    gated_delta_decode,
    gated_delta_sequential,
    gated_delta_traced,
    group_gates,
    traced_layer,
    traced_state,
)

HK, HV, DK, DV = 2, 4, 16, 24
ATOL = 1e-5


def _inputs(length: int, seed: int) -> tuple[mx.array, ...]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> mx.array:
        return mx.array(rng.normal(size=shape).astype(np.float32))

    q, k = normalize_qk(normal(1, length, HK, DK), normal(1, length, HK, DK))
    v = normal(1, length, HV, DV)
    # exp(A_log) from 0.01 (slow decay) to 16 (fast): both must survive the chunking.
    a_log = mx.log(mx.array([0.01, 0.5, 4.0, 16.0]))
    log_g = log_decay(-mx.exp(a_log), normal(1, length, HV) + normal(HV))
    beta = mx.sigmoid(normal(1, length, HV))
    state = 0.1 * normal(1, HV, DV, DK)
    return q, k, v, log_g, beta, state


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 63, 64, 65, 130])
def test_chunked_equals_sequential(length: int, chunk_size: int) -> None:
    q, k, v, log_g, beta, state = _inputs(length, seed=length)
    y_seq, s_seq = gated_delta_sequential(q, k, v, log_g, beta, state)
    y_chunk, s_chunk = gated_delta_chunked(q, k, v, log_g, beta, state, chunk_size=chunk_size)
    assert y_chunk.shape == (1, length, HV, DV) and s_chunk.shape == (1, HV, DV, DK)
    assert s_chunk.dtype == mx.float32
    np.testing.assert_allclose(np.array(y_chunk), np.array(y_seq), atol=ATOL)
    np.testing.assert_allclose(np.array(s_chunk), np.array(s_seq), atol=ATOL)


@pytest.mark.parametrize("by_matmul", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_decode_step_equals_sequential(compiled: bool, by_matmul: bool) -> None:
    """The one-token form (its GPU products by matmul, and the CPU's by
    reductions) fed token by token, two rows at once, equals the reference
    recurrence on each row."""
    rows = [_inputs(9, seed=seed) for seed in (3, 4)]
    q, k, v, log_g, beta, state = (mx.concatenate(p, axis=0) for p in zip(*rows, strict=True))
    y_seq, s_seq = gated_delta_sequential(q, k, v, log_g, beta, state)

    def decode(q, k, v, log_g, beta, state):  # type: ignore[no-untyped-def]
        gates = group_gates(log_g, HK), group_gates(beta, HK)
        return gated_delta_decode(q, k, v, *gates, state, by_matmul=by_matmul)

    step = mx.compile(decode) if compiled else decode
    ys = []
    for t in range(9):
        y, state = step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1],
                        log_g[:, t : t + 1], beta[:, t : t + 1], state)  # fmt: skip
        ys.append(y)
    assert state.dtype == mx.float32 and state.shape == (2, HV, DV, DK)
    np.testing.assert_allclose(np.array(mx.concatenate(ys, axis=1)), np.array(y_seq), atol=ATOL)
    np.testing.assert_allclose(np.array(state), np.array(s_seq), atol=ATOL)


@pytest.mark.parametrize("fused_forms", [False, True])
@pytest.mark.parametrize("length", [129, 300, 512])
def test_grouped_preparation_is_one_group_bit_for_bit(length: int, fused_forms: bool) -> None:
    """A long forward prepared a group of chunks at a time (what bounds its
    memory) gives exactly what preparing every chunk at once gives: the
    groups cut at chunk boundaries, and each chunk's arithmetic is the same
    in any group. With a GPU's forms too (the doubling inverse)."""
    q, k, v, log_g, beta, state = _inputs(length, seed=length)
    built = fused.BUILD_FOR_GPU
    fused.BUILD_FOR_GPU = fused_forms
    try:
        whole = gated_delta_chunked(q, k, v, log_g, beta, state, 16, group_tokens=length + 64)
        grouped = gated_delta_chunked(q, k, v, log_g, beta, state, 16, group_tokens=100)
        mx.eval(whole, grouped)
    finally:
        fused.BUILD_FOR_GPU = built
    for a, b in zip(whole, grouped, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


def _scratch_bytes(length: int, group_tokens: int) -> int:
    """What :func:`gated_delta_chunked` holds above its inputs, at its peak."""
    inputs = _inputs(length, seed=1)
    mx.eval(inputs)
    mx.clear_cache()  # every buffer new: none a larger cached one
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(gated_delta_chunked(*inputs, 64, group_tokens=group_tokens))
    return mx.get_peak_memory() - base


def test_a_long_forward_holds_a_bounded_preparation() -> None:
    """Doubling a grouped forward's length adds to its peak little more than
    the longer output (gathered, then joined): the preparation held at once
    is the groups', not the length's. Preparing every chunk of 4,096 tokens
    at once holds more than twice the grouped peak."""
    grouped = _scratch_bytes(2048, group_tokens=256)
    longer = _scratch_bytes(4096, group_tokens=256)
    assert longer < 1.6 * grouped
    assert _scratch_bytes(4096, group_tokens=4096) > 2 * longer


def test_state_carries_across_calls() -> None:
    """Two chunked calls (split at an odd point) equal one sequential pass."""
    q, k, v, log_g, beta, state = _inputs(101, seed=5)
    y_seq, s_seq = gated_delta_sequential(q, k, v, log_g, beta, state)
    cut = 37
    y1, mid = gated_delta_chunked(
        q[:, :cut], k[:, :cut], v[:, :cut], log_g[:, :cut], beta[:, :cut], state, 16
    )
    y2, end = gated_delta_chunked(
        q[:, cut:], k[:, cut:], v[:, cut:], log_g[:, cut:], beta[:, cut:], mid, 16
    )
    np.testing.assert_allclose(
        np.array(mx.concatenate([y1, y2], axis=1)), np.array(y_seq), atol=ATOL
    )
    np.testing.assert_allclose(np.array(end), np.array(s_seq), atol=ATOL)


def test_conv_tail_continues_the_sequence() -> None:
    """Feeding pieces (some shorter than the tail) through the tail equals one pass."""
    rng = np.random.default_rng(0)
    x = mx.array(rng.normal(size=(1, 23, 6)).astype(np.float32))
    weight = mx.array(rng.normal(size=(6, 4, 1)).astype(np.float32))
    whole, whole_tail = causal_conv_with_tail(x, None, weight)
    pieces, tail, start = [], None, 0
    for size in [1, 2, 9, 1, 10]:
        out, tail = causal_conv_with_tail(x[:, start : start + size], tail, weight)
        pieces.append(out)
        start += size
    assert tail.shape == (1, 3, 6)
    np.testing.assert_allclose(np.array(mx.concatenate(pieces, axis=1)), np.array(whole), atol=1e-6)
    np.testing.assert_array_equal(np.array(tail), np.array(whole_tail))
    np.testing.assert_array_equal(np.array(whole_tail), np.array(x[:, -3:]))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("length", [1, 3, 64])
def test_conv_taps_equal_mlx_conv1d(length: int, dtype: mx.Dtype) -> None:
    """The conv as its taps (what every backend runs) gives ``mx.conv1d``'s
    values over the same padded input: bit for bit in float32, and within one
    bfloat16 rounding (both accumulate in float32) in bfloat16."""
    rng = np.random.default_rng(length)
    x = mx.array(rng.normal(size=(2, length, 40)).astype(np.float32)).astype(dtype)
    tail = mx.array(rng.normal(size=(2, 3, 40)).astype(np.float32)).astype(dtype)
    weight = mx.array(rng.normal(size=(40, 4, 1)).astype(np.float32)).astype(dtype)
    out, _ = causal_conv_with_tail(x, tail, weight)
    reference = mx.conv1d(mx.concatenate([tail, x], axis=1), weight, groups=40)
    assert out.dtype == reference.dtype == dtype
    if dtype == mx.float32:
        np.testing.assert_array_equal(np.array(out), np.array(reference))
    else:
        np.testing.assert_allclose(
            np.array(out.astype(mx.float32)), np.array(reference.astype(mx.float32)), rtol=1e-2
        )


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_the_gpu_inverse_equals_lapacks(chunk_size: int) -> None:
    """The doubling inverse (used on GPUs) against LAPACK's, on the chunk
    matrices the rule really builds (unit keys, sigmoid betas, decays)."""
    from turbospark.layers.gated_delta import rule as gd

    length = 4 * chunk_size
    _, k, _, log_g, beta, _ = _inputs(length, seed=7)
    k = mx.repeat(k, HV // HK, axis=2).moveaxis(2, 1).reshape(1, HV, 4, chunk_size, DK)
    log_g = log_g.moveaxis(2, 1).reshape(1, HV, 4, chunk_size)
    beta = beta.moveaxis(2, 1).reshape(1, HV, 4, chunk_size)
    decay = mx.exp(gd._segment_sums(log_g))
    m = mx.where(
        mx.eye(chunk_size, dtype=mx.bool_),
        0.0,
        ((k * beta[..., None]) @ mx.swapaxes(k, -1, -2)) * decay,
    )
    expected = mx.linalg.tri_inv(mx.eye(chunk_size) + m, upper=False, stream=mx.cpu)
    np.testing.assert_allclose(np.array(gd._doubling_inverse(m)), np.array(expected), atol=2e-5)


@pytest.mark.parametrize("length", [1, 2, 3, 5, 8])
def test_traced_pass_equals_token_steps(length: int) -> None:
    """A verify pass's one-chunk form: its outputs, its last state and the
    state it rebuilds after every earlier token equal stepping token by token."""
    q, k, v, log_g, beta, state = _inputs(length, seed=40 + length)
    y, last, trace = mx.compile(gated_delta_traced)(q, k, v, log_g, beta, state)
    y_seq, s_seq = gated_delta_sequential(q, k, v, log_g, beta, state)
    np.testing.assert_allclose(np.array(y), np.array(y_seq), atol=ATOL)
    np.testing.assert_allclose(np.array(last), np.array(s_seq), atol=ATOL)
    for n in range(1, length + 1):
        cut = (x[:, :n] for x in (q, k, v, log_g, beta))
        _, s_n = gated_delta_sequential(*cut, state)
        np.testing.assert_allclose(
            np.array(traced_state(state, trace, n)), np.array(s_n), atol=ATOL
        )


def test_traced_layer_rebuilds_the_conv_tail() -> None:
    """The conv tail after n tokens of a traced pass is the one a conv over
    those n tokens alone leaves."""
    rng = np.random.default_rng(7)
    tail = mx.array(rng.normal(size=(1, 3, 6)).astype(np.float32))
    projected = mx.array(rng.normal(size=(1, 5, 6)).astype(np.float32))
    weight = mx.array(rng.normal(size=(6, 4, 1)).astype(np.float32))
    q, k, v, log_g, beta, state = _inputs(5, seed=9)
    _, _, recurrence = gated_delta_traced(q, k, v, log_g, beta, state)
    for n in range(1, 6):
        _, expected = causal_conv_with_tail(projected[:, :n], tail, weight)
        got, _ = traced_layer(tail, state, (projected, *recurrence), n)
        np.testing.assert_array_equal(np.array(got), np.array(expected))


@pytest.mark.parametrize("compiled", [False, True])
def test_one_token_gpu_forms_equal_the_cpu_forms(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mix`` for one token takes fewer-kernel forms on a GPU (the conv as
    fused taps, q scaled as k with the gated norm's eps absorbing it, the
    rearranged step); forced on here, they give the CPU forms' output and
    state, two rows and four tokens in a row."""
    rng = np.random.default_rng(7)

    def normal(*shape: int, scale: float = 1.0) -> mx.array:
        return mx.array((scale * rng.normal(size=shape)).astype(np.float32))

    hidden, kernel = 32, 4
    conv_dim = 2 * HK * DK + HV * DV
    columns = conv_dim + HV * DV + 2 * HV
    weights = (normal(hidden, columns, scale=0.2), normal(conv_dim, kernel, 1),
               -mx.array([0.01, 0.5, 4.0, 16.0]), input_bias(normal(HV), columns),
               1.0 + normal(DV, scale=0.1))  # fmt: skip
    xs = [normal(2, 1, hidden) for _ in range(4)]
    start = (normal(2, kernel - 1, conv_dim), 0.1 * normal(2, HV, DV, DK))
    runs = []
    for gpu in (False, True):
        monkeypatch.setattr(fused, "BUILD_FOR_GPU", gpu)
        step = mx.compile(mix) if compiled else mix  # a fresh trace for each form
        tail, recurrent, outs = *start, []
        in_t, conv, rate, in_bias, norm = weights  # rate: -exp(A_log)
        for x in xs:
            out, tail, recurrent = step(x, in_t, tail, recurrent, conv, rate, in_bias, norm,
                                        HK, HV, DK, DV, 1e-6)  # fmt: skip
            outs.append(out)
        runs.append((mx.concatenate(outs, axis=1), tail, recurrent))
    for cpu, gpu in zip(*runs, strict=True):
        np.testing.assert_allclose(np.array(gpu), np.array(cpu), atol=ATOL)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("length", [1, 2, 5, 8])
def test_short_traced_pass_gpu_forms_equal_the_cpu_forms(length: int, compiled: bool) -> None:
    """A GPU's short traced pass (``mix_unrolled``: the one-token forms
    stepped token by token) gives the CPU's (one WY chunk and its trace): the
    output, and after every one of its tokens the conv tail and the state a
    rollback takes."""
    rng = np.random.default_rng(length)

    def normal(*shape: int, scale: float = 1.0) -> mx.array:
        return mx.array((scale * rng.normal(size=shape)).astype(np.float32))

    hidden, kernel = 32, 4
    conv_dim = 2 * HK * DK + HV * DV
    columns = conv_dim + HV * DV + 2 * HV
    in_t, conv = normal(hidden, columns, scale=0.2), normal(conv_dim, kernel, 1)
    rest = (
        -mx.array([0.01, 0.5, 4.0, 16.0]),  # -exp(A_log)
        input_bias(normal(HV), columns),
        1.0 + normal(DV, scale=0.1),
    )
    x, tail, recurrent = (
        normal(1, length, hidden),
        normal(1, kernel - 1, conv_dim),
        0.1 * normal(1, HV, DV, DK),
    )
    args = (x, in_t, tail, recurrent, conv, *rest, HK, HV, DK, DV, 1e-6)
    out_cpu, _, _, trace = mix(*args, traced=True)
    unrolled = mx.compile(mix_unrolled) if compiled else mix_unrolled
    out_gpu, padded, *states = unrolled(*args)
    np.testing.assert_allclose(np.array(out_gpu), np.array(out_cpu), atol=ATOL)
    for n in range(1, length + 1):
        cpu = traced_layer(tail, recurrent, trace, n)
        gpu = unrolled_layer(padded, states, recurrent.shape, n)
        np.testing.assert_array_equal(np.array(gpu[0]), np.array(cpu[0]))
        np.testing.assert_allclose(np.array(gpu[1]), np.array(cpu[1]), atol=ATOL)


def test_decay_rate_is_kept_until_a_log_is_replaced() -> None:
    """``-exp(A_log)`` is computed once, is no parameter, and follows a new ``A_log``
    (a load or a shard replaces the array)."""
    mixer = nn.Module()
    mixer.A_log = mx.array([0.0, 1.0])
    first = decay_rate(mixer)
    assert decay_rate(mixer) is first
    np.testing.assert_allclose(np.array(first), -np.exp([0.0, 1.0]), rtol=1e-6)
    assert set(mixer.parameters()) == {"A_log"}
    mixer.A_log = mx.array([2.0, 3.0])
    np.testing.assert_allclose(np.array(decay_rate(mixer)), -np.exp([2.0, 3.0]), rtol=1e-6)


def test_the_input_bias_follows_its_projections_dtype_and_width() -> None:
    """Kept per ``dt_bias``, the bias still follows projections replaced
    under it (another dtype, another width): each read is what a fresh
    mixer would build for them."""
    mixer = nn.Module()
    mixer.dt_bias = mx.arange(HV, dtype=mx.float32)
    for dtype, width in [(mx.float32, 40), (mx.float16, 40), (mx.float16, 48)]:
        got = mixer_input_bias(mixer, mx.zeros((8, width), dtype))
        assert got.dtype == dtype and got.shape == (width,)
        assert mx.array_equal(got, input_bias(mixer.dt_bias.astype(dtype), width)).item()
