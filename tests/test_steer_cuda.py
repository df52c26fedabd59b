"""The one-launch CUDA steering kernel against the compiled ops it replaces.

Runs only where MLX has its CUDA backend (the H200 bench machine:
``python3 -m pytest tests/test_steer_cuda.py``); on CPU and Metal the compiled
ops are the only path, and ``tests/test_steering.py`` checks them against NumPy.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from turbospark.layers.cuda import steer as steer_cuda
from turbospark.policies.steering import Steer, SteeringPolicy

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")

ROWS = [("renorm", 0.7), ("ablate", 1.0), ("clamp", -0.4), ("add", 1.3), None]


def _policies(hidden: int, rng: np.random.Generator) -> list[SteeringPolicy | None]:
    vector = {1: rng.standard_normal(hidden).astype(np.float32)}
    return [
        None if row is None else SteeringPolicy.from_directions(vector, row[1], row[0])
        for row in ROWS
    ]


@pytest.mark.parametrize("hidden", [64, 300, 2048])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_one_launch_equals_the_compiled_ops(hidden: int, dtype: mx.Dtype) -> None:
    mx.set_default_device(mx.gpu)
    rng = np.random.default_rng(hidden)
    policies = _policies(hidden, rng)
    steer = Steer.of(policies, dtype)
    assert steer is not None and steer.layers[1].one_launch is not None
    compiled = dataclasses.replace(steer.layers[1], one_launch=None)
    h = mx.array(rng.standard_normal((len(ROWS), 1, hidden)) * 3, dtype=dtype)
    fast, slow = steer(1, h), compiled(h)
    # Against the compiled ops in float32: the kernel rounds once, they round per op.
    wide = Steer.of(policies, mx.float32).layers[1]
    reference = dataclasses.replace(wide, one_launch=None)(h.astype(mx.float32))
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(fast.astype(mx.float32)), np.array(reference),
                               rtol=tolerance, atol=tolerance * 3)  # fmt: skip
    np.testing.assert_allclose(np.array(slow.astype(mx.float32)), np.array(reference),
                               rtol=tolerance * 2, atol=tolerance * 6)  # fmt: skip
    assert mx.array_equal(fast[-1], h[-1])  # an unsteered row is the identity, exactly
    assert steer_cuda.available()


def test_prefill_takes_the_compiled_ops() -> None:
    """Chunks of more than one token go through the compiled ops (the kernel is
    one token per block), and agree with the kernel token by token."""
    mx.set_default_device(mx.gpu)
    rng = np.random.default_rng(0)
    policies = _policies(256, rng)[:1]
    steer = Steer.of(policies, mx.float32)
    h = mx.array(rng.standard_normal((1, 5, 256)), dtype=mx.float32)
    whole = steer(1, h)
    one_by_one = mx.concatenate([steer(1, h[:, i : i + 1]) for i in range(5)], axis=1)
    np.testing.assert_allclose(np.array(whole), np.array(one_by_one), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_join_inside_the_launch_equals_the_join_then_the_launch(
    scaled: bool, dtype: mx.Dtype
) -> None:
    """Handed a family's last join, the kernel computes it as the join's own
    kernel does (rounding after each op), so the result is the kernel's on the
    joined ``h``, bit for bit, in every mode at once."""
    mx.set_default_device(mx.gpu)
    rng = np.random.default_rng(7)
    hidden = 1536
    steer = Steer.of(_policies(hidden, rng), dtype)
    assert steer is not None
    layer = steer.layers[1]
    h, update = (
        mx.array(rng.standard_normal((len(ROWS), 1, hidden)) * 2, dtype=dtype) for _ in range(2)
    )
    scale = mx.array([0.37], dtype=dtype) if scaled else None
    joined = h + update if scale is None else (h + update) * scale
    assert mx.array_equal(steer.joiner(1)(h, update, scale), layer(joined))
    assert mx.array_equal(steer.joiner(1)(h, update, scale)[-1], joined[-1])
