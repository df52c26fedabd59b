"""The CPU's float32 tanh (``fused.tanh``) against MLX's, and what uses it
(GELU, SiLU, the logit softcap).

On the CPU a float32 tanh is a rational function of multiply-adds (libm's
scalar ``tanhf`` cost a Gemma decode step a tenth of its time); it must stay
within float32 rounding of MLX's everywhere, and every other dtype keeps
MLX's own op bit for bit.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from turbospark.layers import fused

# Measured 3.6e-7 at most over the grid below: about 6 ulps where tanh is near 1.
TANH_ATOL = 4e-7


def grid() -> mx.array:
    dense = np.linspace(-20, 20, 400_001, dtype=np.float32)
    tiny = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-8, -3e-4, 7.9, -7.9, 8.0, 1e4], np.float32)
    return mx.array(np.concatenate([dense, tiny]))


def gated_bound(gate: mx.array, up: mx.array, expected: np.ndarray) -> np.ndarray:
    """How far ``act(gate) * up`` may move when act is ``g * (1 + tanh(.)) / 2``:
    ``|gate * up| / 2`` times tanh's error (most where tanh is near -1), plus
    float32 rounding of the rest."""
    return 0.5 * np.abs(np.array(gate * up)) * TANH_ATOL + 1e-6 * np.abs(expected) + 1e-7


def test_tanh_is_within_a_few_ulps_of_mlx_tanh() -> None:
    x = grid()
    got, expected = np.array(fused.tanh(x)), np.array(mx.tanh(x))
    np.testing.assert_allclose(got, expected, rtol=0, atol=TANH_ATOL)
    assert np.all(np.abs(got) <= 1.0)
    assert np.array_equal(np.sign(got), np.sign(expected))  # odd, and 0 at 0


def test_tanh_of_infinities_and_nan() -> None:
    got = np.array(fused.tanh(mx.array([np.inf, -np.inf, np.nan], mx.float32)))
    np.testing.assert_allclose(got[:2], [1.0, -1.0], atol=TANH_ATOL)
    assert np.isnan(got[2])


def test_compiled_tanh_equals_uncompiled() -> None:
    x = grid()
    compiled = mx.compile(fused.tanh, shapeless=True)
    assert np.array_equal(np.array(compiled(x)), np.array(fused.tanh(x)))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_other_dtypes_keep_mlx_tanh_and_gelu(dtype: mx.Dtype) -> None:
    x = (mx.random.normal((4, 257), key=mx.random.key(0)) * 4).astype(dtype)
    assert mx.array_equal(fused.tanh(x), mx.tanh(x)).item()
    assert mx.array_equal(fused.gelu_approx(x), nn.gelu_approx(x)).item()
    assert mx.array_equal(fused.silu(x), nn.silu(x)).item()


def test_geglu_and_softcap_match_mlx_forms_within_rounding() -> None:
    key = mx.random.key(1)
    gate = mx.random.normal((8, 1, 2048), key=key) * 3
    up = mx.random.normal((8, 1, 2048), key=mx.random.split(key)[0])
    got, expected = np.array(fused.geglu(gate, up)), np.array(nn.gelu_approx(gate) * up)
    assert np.all(np.abs(got - expected) <= gated_bound(gate, up, expected))
    logits = mx.random.normal((3, 512), key=mx.random.key(2)) * 60
    cap = 30.0
    np.testing.assert_allclose(
        np.array(fused.softcap(logits, cap)),
        np.array(mx.tanh(logits / cap) * cap),
        rtol=0,
        atol=cap * TANH_ATOL * 2,
    )


def test_gelu_approx_is_the_tanh_formula() -> None:
    x = mx.array(np.linspace(-8, 8, 10_001, dtype=np.float32))
    c = math.sqrt(2 / math.pi)
    expected = 0.5 * x * (1 + mx.tanh(c * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(
        np.array(fused.gelu_approx(x)), np.array(expected), rtol=1e-6, atol=1e-6
    )


def test_silu_and_swiglu_match_mlx_forms_within_rounding() -> None:
    x = grid()
    got, expected = np.array(fused.silu(x)), np.array(nn.silu(x))
    # x * (1 + tanh(x / 2)) / 2 moves by |x| / 2 times tanh's error, plus the
    # output's own rounding (a few ulps of it).
    bound = 0.5 * np.abs(np.array(x)) * TANH_ATOL + 3e-7 * np.abs(expected) + 1e-7
    assert np.all(np.abs(got - expected) <= bound)
    extremes = mx.array([-np.inf, np.inf, np.nan], mx.float32)  # as MLX's: nan, inf, nan
    np.testing.assert_array_equal(np.array(fused.silu(extremes)), np.array(nn.silu(extremes)))
    gate = mx.random.normal((8, 1, 3072), key=mx.random.key(3)) * 4
    up = mx.random.normal((8, 1, 3072), key=mx.random.key(4))
    got, expected = np.array(fused.swiglu(gate, up)), np.array(nn.silu(gate) * up)
    assert np.all(np.abs(got - expected) <= gated_bound(gate, up, expected))
