"""Kept step weights follow every replaced array, whichever way it is replaced."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from turbospark.layers.layer_step import MISSING, held, kept
from turbospark.layers.stacked import Packed, transposed

WIDTH = 64  # a whole quantization group of 32, twice


class Owner(nn.Module):
    """A layer-like module: a quantized projection, a float one, a norm, a
    plain array and a plain dict of arrays (its items not counted)."""

    def __init__(self, seed: int):
        super().__init__()
        self.packed = nn.QuantizedLinear(WIDTH, WIDTH, bias=False, group_size=32, bits=4)
        self.linear = nn.Linear(WIDTH, WIDTH, bias=True)
        self.norm = nn.RMSNorm(WIDTH)
        self.scalar = mx.array([0.5])
        self.table = {"row": mx.zeros((WIDTH,))}
        rng = np.random.default_rng(seed)
        self.update(
            nn.utils.tree_map(
                lambda a: mx.array(rng.standard_normal(a.shape).astype(np.float32)),
                self.parameters(),
            ),
            strict=False,
        )
        # the packed weight as packed: quantize a random float one
        w, scales, biases = mx.quantize(
            mx.array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)), 32, 4
        )
        self.packed.update({"weight": w, "scales": scales, "biases": biases})


PATHS = [("packed", "weight"), ("linear", "weight"), ("norm", "weight"), ("scalar",)]
PATHS += [("table", "row")]


def _derived(owner: Owner) -> tuple[Packed | mx.array, ...]:
    """What a step would read of *owner*, as a layer step's weights are."""
    packed = transposed(owner["packed"])
    assert isinstance(packed, Packed)
    return (
        packed,
        transposed(owner["linear"]),
        owner["linear"]["bias"],
        owner["norm"]["weight"],
        owner["scalar"],
        owner["table"]["row"],
    )


def _step(owner: Owner, x: mx.array) -> mx.array:
    """A step over the kept weights (each array it read counts)."""
    packed, linear_t, bias, norm_w, scalar, row = kept(
        owner, lambda: _derived(owner), lambda: PATHS
    )
    w, scales, biases, group_size, bits, mode = packed
    y = mx.quantized_matmul(x, w, scales, biases, True, group_size, bits, mode)
    y = mx.addmm(bias, y, linear_t)
    return mx.fast.rms_norm(y, norm_w, 1e-6) * scalar + row


def _fresh_like(owner: Owner) -> Owner:
    """A model never stepped, holding *owner*'s arrays as they are now."""
    fresh = Owner(seed=9)
    fresh.update(owner.parameters(), strict=False)
    fresh.table = dict(owner.table)
    return fresh


X = mx.array(np.random.default_rng(5).standard_normal((1, WIDTH)).astype(np.float32))


def _replacements() -> dict[str, Callable[[Owner, Owner], None]]:
    """Each way to replace each array the kept weights read, from *other*."""

    def item(module: str, name: str) -> Callable[[Owner, Owner], None]:
        return lambda owner, other: owner[module].__setitem__(name, other[module][name])

    arrays = {"packed": ("weight", "scales", "biases"), "linear": ("weight", "bias")}
    arrays["norm"] = ("weight",)
    ways: dict[str, Callable[[Owner, Owner], None]] = {
        f"{module}.{name}": item(module, name) for module, names in arrays.items() for name in names
    }
    ways["scalar by attribute"] = lambda owner, other: setattr(owner, "scalar", other.scalar)
    ways["table row (a plain dict)"] = lambda owner, other: owner.table.__setitem__(
        "row", other.table["row"]
    )
    ways["norm module"] = lambda owner, other: setattr(owner, "norm", other.norm)
    ways["packed module by update_modules"] = lambda owner, other: owner.update_modules(
        {"packed": other.packed}
    )
    ways["every parameter by update"] = lambda owner, other: owner.update(
        other.parameters(), strict=False
    )
    return ways


@pytest.mark.parametrize("way", list(_replacements()))
def test_a_kept_value_follows_every_replaced_array(way: str) -> None:
    """Stepped, then one array (or the module holding it) replaced by
    another model's: the next step equals a model that never stepped and
    holds the same arrays, and differs from the step before."""
    owner, other = Owner(seed=1), Owner(seed=2)
    before = _step(owner, X)
    _step(owner, X)  # held, its links recorded as holding
    _replacements()[way](owner, other)
    after = _step(owner, X)
    np.testing.assert_array_equal(np.array(after), np.array(_step(_fresh_like(owner), X)))
    assert not np.allclose(np.array(after), np.array(before))


def test_a_kept_value_is_derived_once_while_its_links_hold() -> None:
    """A write to another model's module leaves the links holding: nothing is
    derived again until one of the value's own arrays is replaced."""
    owner = Owner(seed=1)
    derived: list[int] = []

    def derive() -> tuple[Packed | mx.array, ...]:
        derived.append(1)
        return _derived(owner)

    first = kept(owner, derive, lambda: PATHS)
    assert kept(owner, derive, lambda: PATHS) is first
    Owner(seed=3).norm.weight = mx.ones((WIDTH,))  # another model's module written
    assert kept(owner, derive, lambda: PATHS) is first
    assert held(owner) is first and len(derived) == 1
    owner.norm.weight = mx.ones((WIDTH,))
    assert held(owner) is MISSING
