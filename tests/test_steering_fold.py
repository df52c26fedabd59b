"""A steered layer's compiled step is one compiled call (:meth:`Join.fold`):
the family's tail, its last join and the steering traced together, where the
two-call path it replaces compiled the tail alone, then ran the steering's
joined kernel. Over the families' real tail functions (random weights) and
their decode steps: the fold equals the two-call path bit for bit, matches
the NumPy reference, is exact identity at scale 0, steers each row of a batch
as that row alone, and traces once. Float32 on CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
import pytest
from test_steering import numpy_reference

import turbospark.policies.steering
from turbospark import Runner, build_synthetic_install
from turbospark.contract.protocols import Parts
from turbospark.layers.layer_end import parts as end_parts
from turbospark.layers.layer_end import tail_step
from turbospark.policies.steering import Steer, SteeringPolicy, _LayerSteer, joiner

HIDDEN, INNER, PLE, EPS = 32, 48, 8, 1e-6
ROWS = ("add", "ablate", None, "clamp", "renorm")


def _gemma4_args(rng: np.random.Generator, batch: int, length: int, ple: bool) -> tuple[Any, ...]:
    """The layer end's arguments (:func:`~turbospark.layers.layer_end.parts`)
    for gemma4's architecture: residual, attention output, the per-layer
    input, the norms' and matmuls' weights (transposed), the PLE block's and
    the layer scalar."""

    def a(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    dense = (a(HIDDEN), a(HIDDEN), a(HIDDEN, 2 * INNER) * 0.2, a(INNER, HIDDEN) * 0.2, a(HIDDEN))
    block = (a(HIDDEN, PLE) * 0.2, a(PLE, HIDDEN) * 0.2, a(HIDDEN)) if ple else None
    per_layer_input = a(batch, length, PLE) if ple else None
    h, attn = a(batch, length, HIDDEN), a(batch, length, HIDDEN)
    weights = (*dense, block, mx.array([0.8], dtype=mx.float32))
    return h, attn, per_layer_input, weights, EPS, True


def _qwen_args(rng: np.random.Generator, batch: int, length: int) -> tuple[Any, ...]:
    """The layer end's arguments for qwen_gdn's (pre-norm) architecture: the
    residual stream after the mixer, the MLP's norm and weights."""

    def a(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    weights = (
        None,
        a(HIDDEN),
        a(HIDDEN, 2 * INNER) * 0.2,
        a(INNER, HIDDEN) * 0.2,
        None,
        None,
        None,
    )
    return a(batch, length, HIDDEN), None, None, weights, EPS, False


class Tail(NamedTuple):
    parts: Parts  # up to the layer's last join (what a steered layer folds)
    whole: Callable[..., mx.array]  # the layer end's compiled tail, join included
    args: tuple[Any, ...]
    scale: mx.array | None  # the join's layer scalar (None: a plain add)


def _tail(name: str, batch: int, length: int = 1, seed: int = 0) -> Tail:
    """*name*'s tail over ``(batch, length)`` tokens: a decode step, or a lone
    row's short verify pass (also compiled, ``runs_compiled``)."""
    rng = np.random.default_rng(seed)
    if name == "qwen_gdn":
        args = _qwen_args(rng, batch, length)
    else:
        args = _gemma4_args(rng, batch, length, ple=name == "gemma4-ple")
    return Tail(end_parts, tail_step, args, args[3][6])


TAILS = ["gemma4", "gemma4-ple", "qwen_gdn"]


def _policy(mode: str | None, scale: float = 1.5, seed: int = 3) -> SteeringPolicy | None:
    if mode is None:
        return None
    v = np.random.default_rng(seed).standard_normal(HIDDEN).astype(np.float32) * 2
    return SteeringPolicy.from_directions({1: v, 2: -v}, scale, mode, layers=(1, 2))


def _two_calls(entry: _LayerSteer, parts: Parts, args: tuple, scale: mx.array | None):
    """The path the fold replaces (for one layer of a :class:`Steer`): the tail
    compiled alone, then the steering's joined kernel."""
    return entry.join(*turbospark.policies.steering._compiled(parts)(*args), scale)


@pytest.mark.parametrize("rows", [*[[m] for m in ROWS if m], list(ROWS)], ids=str)
@pytest.mark.parametrize("length", [1, 4])
@pytest.mark.parametrize("tail", TAILS)
def test_fold_equals_the_two_call_path_bit_for_bit(
    tail: str, length: int, rows: list[str | None]
) -> None:
    """Every mode alone and all of them (and an unsteered row) in one batch,
    on a covered layer and one (3) no row covers."""
    parts, _, args, scale = _tail(tail, len(rows), length)
    steer = Steer.of([_policy(m, seed=i) for i, m in enumerate(rows)], mx.float32)
    assert steer is not None
    for layer in (1, 2, 3):
        folded = joiner(steer, layer).fold(parts, args, scale, compiled=True)
        two = _two_calls(
            steer.layers.get(layer, turbospark.policies.steering._UNSTEERED), parts, args, scale
        )
        assert mx.array_equal(folded, two), layer
        plain = joiner(steer, layer).fold(parts, args, scale, compiled=False)
        np.testing.assert_allclose(np.array(folded), np.array(plain), rtol=1e-5, atol=1e-5)
        # Any other hook: the tail compiled alone, the join, then the hook.
        hook = joiner(lambda i, h: steer(i, h), layer).fold(parts, args, scale, compiled=True)
        np.testing.assert_allclose(np.array(folded), np.array(hook), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["add", "ablate", "clamp", "renorm"])
@pytest.mark.parametrize("tail", TAILS)
def test_fold_matches_numpy(tail: str, mode: str) -> None:
    parts, _, args, scale = _tail(tail, 2)
    policy = _policy(mode, scale=-0.7)
    steer = Steer.of([policy, policy], mx.float32)
    folded = np.array(joiner(steer, 1).fold(parts, args, scale, compiled=True))
    joined = np.array(turbospark.policies.steering._join(*parts(*args), scale))
    expected = numpy_reference(joined, policy.directions[1], -0.7, mode)
    np.testing.assert_allclose(folded, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["add", "renorm"])
@pytest.mark.parametrize("tail", TAILS)
def test_fold_at_scale_zero_equals_the_unsteered_tail(tail: str, mode: str) -> None:
    """``add``/``renorm`` at s = 0 is identity: the family's own compiled tail
    (bit for bit where the tail is its parts' sum, gemma4's; qwen_gdn's tail
    makes its residual add inside the down projection's GEMM, an ``addmm``
    that rounds once where parts then a join round twice)."""
    parts, whole, args, scale = _tail(tail, 3)
    steer = Steer.of([_policy(mode, scale=0.0)] * 3, mx.float32)
    folded = joiner(steer, 1).fold(parts, args, scale, compiled=True)
    off = whole(*args)
    if tail.startswith("gemma4"):
        assert mx.array_equal(folded, off)
    np.testing.assert_allclose(np.array(folded), np.array(off), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tail", TAILS)
def test_batch_rows_fold_as_each_row_alone(tail: str) -> None:
    """Rows under every mode and none: each equals its own one-row fold (the
    matmuls of a batch may round apart from a row's, so to float32 rounding)."""
    parts, _, args, scale = _tail(tail, len(ROWS))
    policies = [_policy(m, seed=i) for i, m in enumerate(ROWS)]
    batched = np.array(
        joiner(Steer.of(policies, mx.float32), 1).fold(parts, args, scale, compiled=True)
    )
    for i, policy in enumerate(policies):
        row = tuple(a[i : i + 1] if isinstance(a, mx.array) and a.ndim == 3 else a for a in args)
        alone = Steer.of([policy], mx.float32)
        hook = alone if alone is not None else (lambda layer, h: h)
        expected = np.array(joiner(hook, 1).fold(parts, row, scale, compiled=True))
        np.testing.assert_allclose(batched[i : i + 1], expected, rtol=1e-5, atol=1e-5)


# -- whole decode steps -----------------------------------------------------------

FAMILIES = {"gemma4": {"num_layers": 4}, "qwen_gdn": {"num_layers": 4}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def install(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    path = tmp_path_factory.mktemp(f"fold-{family}")
    build_synthetic_install(family, path, model_id=f"fold-{family}", **FAMILIES[family])
    return path


def _decode(path: Path, steering: SteeringPolicy | None, steps: int = 6) -> list[mx.array]:
    runner = Runner.open(path, context_length=64, steering=steering)
    prompt = [3 + i for i in range(11)]
    out = [runner.prefill_chunk(prompt, 0)]
    for i in range(steps):
        out.append(runner.produce(int(mx.argmax(out[-1]).item()), len(prompt) + i))
    mx.eval(out)
    return out


def _every_layer(path: Path, mode: str, scale: float) -> SteeringPolicy:
    runner = Runner.open(path, context_length=8)
    width, layers = runner.arch.hidden_size, runner.arch.num_hidden_layers
    rng = np.random.default_rng(5)
    return SteeringPolicy.from_directions(
        {k: rng.standard_normal(width).astype(np.float32) for k in range(1, layers)}, scale, mode
    )


@pytest.mark.parametrize("mode", ["add", "clamp", "renorm"])
def test_steered_decode_equals_the_two_call_path(
    install: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model, prefill then decode steps: the same logits, bit for bit."""
    steering = _every_layer(install, mode, 0.7)
    folds = {"n": 0}
    real = _LayerSteer.fold

    def counted(self: _LayerSteer, *args: Any) -> mx.array:
        folds["n"] += 1
        return real(self, *args)

    monkeypatch.setattr(_LayerSteer, "fold", counted)
    folded = _decode(install, steering)
    assert folds["n"] > 0  # the decode steps went through the fold
    monkeypatch.setattr(_LayerSteer, "fold", _two_calls)
    two_calls = _decode(install, steering)
    for step, (a, b) in enumerate(zip(folded, two_calls, strict=True)):
        assert mx.array_equal(a, b), f"step {step} differs"
    assert not mx.array_equal(folded[-1], _decode(install, None)[-1])


@pytest.mark.parametrize("mode", ["add", "renorm"])
def test_steered_decode_at_scale_zero_equals_off(install: Path, mode: str) -> None:
    zero = _decode(install, _every_layer(install, mode, 0.0))
    off = _decode(install, None)
    for step, (a, b) in enumerate(zip(zero, off, strict=True)):
        assert mx.array_equal(a, b), f"step {step} differs"


def test_steered_decode_steps_do_not_retrace(install: Path, monkeypatch: pytest.MonkeyPatch):
    """:func:`turbospark.policies.steering.steered` runs only while a fold traces: after
    the first step at a batch size, none."""
    runner = Runner.open(install, context_length=64, steering=_every_layer(install, "renorm", 1))
    runner.prefill_chunk(list(range(3, 14)), 0)
    mx.eval(runner.produce(5, 11))
    calls = {"n": 0}
    real = turbospark.policies.steering.steered

    def counted(*args: Any) -> mx.array:
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(turbospark.policies.steering, "steered", counted)
    for step in range(4):
        mx.eval(runner.produce(7 + step, 12 + step))
    assert calls["n"] == 0
