"""A layer's end (:class:`~turbospark.layers.layer_end.LayerEnd`) as an
architecture states it: each form it chooses (the compiled step, the plain
ops, the norm kernels' joins in their ops, the steered fold, the modules)
equals the modules' own computation, for a sandwich-norm end with a side
input block and a layer scalar (Gemma's), a pre-norm one (Llama's, Qwen's)
and one with neither a side block nor a scalar. Float32 on CPU."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from turbospark.layers.cuda import norm as norm_cuda
from turbospark.layers.cuda.norm import Unjoined
from turbospark.layers.fused import geglu, swiglu
from turbospark.layers.layer_end import LayerEnd
from turbospark.layers.mlp import GatedMLP
from turbospark.policies.steering import Steer, SteeringPolicy, joiner

HIDDEN, INNER, SIDE, EPS = 16, 24, 8, 1e-6
SIDE_NAMES = ("side_gate", "side_proj", "side_norm")


class Layer(nn.Module):
    """A layer's end under checkpoint-like names, its weights random."""

    def __init__(self, kind: str, bias: bool = False, seed: int = 0):
        super().__init__()
        gelu = kind != "pre_norm"
        self.mlp = GatedMLP(HIDDEN, INNER, combine=geglu if gelu else swiglu, bias=bias)
        self.pre = nn.RMSNorm(HIDDEN, eps=EPS)
        if kind == "pre_norm":
            self.end = LayerEnd("pre", EPS)
        else:
            self.post_mixer = nn.RMSNorm(HIDDEN, eps=EPS)
            self.post_mlp = nn.RMSNorm(HIDDEN, eps=EPS)
            side = kind == "sandwich_side"
            if side:
                self.side_gate = nn.Linear(HIDDEN, SIDE, bias=False)
                self.side_proj = nn.Linear(SIDE, HIDDEN, bias=False)
                self.side_norm = nn.RMSNorm(HIDDEN, eps=EPS)
                self.scalar = mx.array([0.7])
            self.end = LayerEnd(
                "pre", EPS, gelu=True, post_mixer="post_mixer", post_mlp="post_mlp",
                side=SIDE_NAMES if side else None, scale="scalar" if side else None,
            )  # fmt: skip
        rng = np.random.default_rng(seed)
        self.update(
            nn.utils.tree_map(
                lambda a: mx.array(rng.standard_normal(a.shape).astype(np.float32) * 0.3),
                self.parameters(),
            )
        )

    def reference(self, h: mx.array, mixed: mx.array, side_input: mx.array | None) -> mx.array:
        """The modules' ops, one by one."""
        if "post_mixer" in self:
            h = h + self.post_mixer(mixed)
            ff = self.post_mlp(self.mlp(self.pre(h)))
            if "side_gate" not in self:
                return h + ff
            h = h + ff
            side = self.side_proj(geglu(self.side_gate(h), side_input))
            return (h + self.side_norm(side)) * self.scalar
        h = h + mixed
        return h + self.mlp(self.pre(h))


KINDS = ["sandwich_side", "sandwich", "pre_norm"]


def _inputs(length: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(1)

    def a(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    return a(2, length, HIDDEN), a(2, length, HIDDEN), a(2, length, SIDE)


def _joined(out: Any) -> mx.array:
    if isinstance(out, Unjoined):
        update = out.update
        if out.update_weight is not None:
            update = mx.fast.rms_norm(update, out.update_weight, out.eps)
        return out.h + update if out.scale is None else (out.h + update) * out.scale
    return out


def _close(a: mx.array, b: mx.array) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("length", [1, 4, 12])  # compiled, a verify pass, prefill
@pytest.mark.parametrize("kind", KINDS)
def test_every_form_equals_the_modules(
    kind: str, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = Layer(kind)
    h, mixed, side_input = _inputs(length)
    side_input = side_input if "side_gate" in layer else None
    expected = layer.reference(h, mixed, side_input)
    _close(layer.end(layer, h, mixed, side_input), expected)
    with monkeypatch.context() as patch:  # the norm kernels, in their ops
        patch.setattr(norm_cuda, "available", lambda: True)
        patch.setattr(norm_cuda, "join_norm", norm_cuda.join_norm_ops)
        assert layer.end.joins_mixer(layer, None)
        out = layer.end(layer, h, mixed, side_input)
        assert isinstance(out, Unjoined)
        _close(_joined(out), expected)
    if kind == "pre_norm":  # the mixer's output projection added the residual
        _close(layer.end(layer, h + mixed, None), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_a_steered_end_folds_the_steering_into_its_join(kind: str) -> None:
    layer = Layer(kind)
    h, mixed, side_input = _inputs(1)
    side_input = side_input if "side_gate" in layer else None
    direction = np.random.default_rng(2).standard_normal(HIDDEN).astype(np.float32)
    policy = SteeringPolicy.from_directions({1: direction}, 0.5, "add", layers=(1, 1))
    steer = Steer.of([policy, policy], mx.float32)
    assert steer is not None
    out = layer.end(layer, h, mixed, side_input, joiner(steer, 1))
    expected = steer(1, layer.reference(h, mixed, side_input))
    _close(out, expected)


def test_an_mlp_with_biases_runs_its_modules() -> None:
    """The traced forms read no bias: a biased MLP takes the modules' path."""
    layer = Layer("pre_norm", bias=True)
    assert layer.end.weights(layer) is None
    h, mixed, _ = _inputs(1)
    _close(layer.end(layer, h, mixed), layer.reference(h, mixed, None))


def _parameter_names(kind: str) -> list[str]:
    return [name for name, _ in tree_flatten(Layer(kind).parameters())]


@pytest.mark.parametrize(
    ("kind", "name"), [(kind, name) for kind in KINDS for name in _parameter_names(kind)]
)
def test_kept_end_weights_follow_every_replaced_array(kind: str, name: str) -> None:
    """:meth:`LayerEnd.weights` is kept between calls: an end that ran, then
    had one array replaced by another layer's (through ``update``), equals a
    layer that never ran holding the same arrays, and differs from before."""
    layer, other = Layer(kind, seed=1), Layer(kind, seed=2)
    h, mixed, side_input = _inputs(1)
    side_input = side_input if "side_gate" in layer else None
    before = layer.end(layer, h, mixed, side_input)
    layer.end(layer, h, mixed, side_input)  # kept, its links recorded as holding
    replacement = dict(tree_flatten(other.parameters()))[name]
    layer.update(tree_unflatten([(name, replacement)]))
    fresh = Layer(kind, seed=3)
    fresh.update(layer.parameters())
    after = layer.end(layer, h, mixed, side_input)
    np.testing.assert_array_equal(np.array(after), np.array(fresh.end(fresh, h, mixed, side_input)))
    assert not np.allclose(np.array(after), np.array(before))


def test_a_replaced_mlp_module_is_read_by_the_kept_end() -> None:
    """A module swapped in by attribute assignment (a reload, a shard) breaks
    the kept weights' link as a replaced array does."""
    layer, other = Layer("sandwich_side", seed=1), Layer("sandwich_side", seed=2)
    h, mixed, side_input = _inputs(1)
    layer.end(layer, h, mixed, side_input)
    layer.mlp = other.mlp
    _close(layer.end(layer, h, mixed, side_input), layer.reference(h, mixed, side_input))
