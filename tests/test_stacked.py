"""Stacked projections: one matmul computes what the separate layers did, the
weights stay the checkpoint's parameters (same names, shapes, one copy in
memory), and replacing a weight after the first forward is seen, as is
replacing a bias, a norm's weight or a packed weight's scales or biases
(everything the stacks and the one-trace steps' kept weights derive from).

The families' own equality to mlx-lm (their parity tests) and sharded against
unsharded (``test_distributed.py``) run through the stacked path; here is the
mechanism, and a whole model whose weights are reloaded after it decoded.
Float32 on CPU.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import dequantize_model
from test_quantized_paths import _close, _kernels, _open, _quantized

from turbospark import build_synthetic_install
from turbospark.generation.runner import Runner
from turbospark.layers import fused
from turbospark.layers import stacked as stacked_mod
from turbospark.layers.stacked import (
    CPU_DEQUANTIZE_ROWS,
    Packed,
    PerModule,
    gemm_add,
    matmul_t,
    project,
    stacked,
    transposed,
)


class Block(nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(24, 32, bias=bias)
        self.k_proj = nn.Linear(24, 16, bias=bias)
        self.v_proj = nn.Linear(24, 8, bias=bias)


NAMES = ("q_proj", "k_proj", "v_proj")


@pytest.mark.parametrize("bias", [False, True])
def test_stack_equals_the_separate_layers_and_keeps_the_parameters(bias: bool) -> None:
    block = Block(bias)
    mx.eval(block.parameters())
    x = mx.random.normal((2, 3, 24), key=mx.random.key(0))
    separate = [getattr(block, name)(x) for name in NAMES]
    before = {k: (v.shape, v.tolist()) for k, v in tree_flatten(block.parameters())}
    mx.eval(separate)
    memory = mx.get_active_memory()
    weights = sum(v.nbytes for _, v in tree_flatten(block.parameters()))

    stack = stacked(block, NAMES)
    assert stack is not None
    # The modules read views of the stack: the weights are held once, not twice.
    assert mx.get_active_memory() - memory < weights / 2
    for got, want in zip(stack(x), separate, strict=True):
        assert mx.allclose(got, want, atol=1e-6).item()
    after = {k: (v.shape, v.tolist()) for k, v in tree_flatten(block.parameters())}
    assert after == before  # same names, shapes and values
    assert stacked(block, NAMES) is stack  # built once


def test_a_replaced_weight_rebuilds_the_stack() -> None:
    block = Block()
    first = stacked(block, NAMES)
    block.k_proj.weight = block.k_proj.weight * 2
    x = mx.ones((1, 1, 24))
    second = stacked(block, NAMES)
    assert second is not first
    assert mx.allclose(second(x)[1], block.k_proj(x)).item()


def test_unstackable_layers_are_left_alone() -> None:
    block = Block()
    block.v_proj = nn.Linear(24, 8, bias=True)  # only one with a bias
    assert stacked(block, NAMES) is None
    block.v_proj = nn.Identity()  # not a plain nn.Linear (as a sharded one is not)
    assert stacked(block, NAMES) is None


def _graph_labels(out: mx.array, tmp_path: Path) -> list[str]:
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), out)
    return re.findall(r'label ="([^"]+)"', dot.read_text())


@pytest.mark.parametrize("bias", [False, True])
def test_project_is_the_module_with_no_transpose_node(bias: bool, tmp_path: Path) -> None:
    linear = nn.Linear(24, 8, bias=bias)
    x = mx.random.normal((2, 3, 24), key=mx.random.key(1))
    assert mx.array_equal(project(linear, x), linear(x)).item()
    # The module's own ``x @ w.T`` is a Transpose node and a Matmul; project, the Matmul.
    assert "Transpose" in _graph_labels(linear(x), tmp_path)
    assert "Transpose" not in _graph_labels(project(linear, x), tmp_path)
    assert transposed(linear) is transposed(linear)  # built once


def test_transposed_follows_a_replaced_weight() -> None:
    linear = nn.Linear(24, 8, bias=False)
    first = transposed(linear)
    linear.weight = linear.weight * 2
    assert transposed(linear) is not first
    x = mx.ones((1, 24))
    assert mx.array_equal(project(linear, x), linear(x)).item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 12])
def test_project_reads_a_quantized_linear_as_packed(bias: bool, rows: int, tmp_path: Path) -> None:
    """A plain ``nn.QuantizedLinear`` is read as :class:`Packed` too, so many
    rows on the CPU take the float matmul of :func:`matmul_t`; the module's
    result, with its bias and a residual, up to float32 rounding."""
    linear = nn.QuantizedLinear(64, 24, bias=bias, group_size=32, bits=4)
    x = mx.random.normal((1, rows, 64), key=mx.random.key(9))
    residual = mx.random.normal((1, rows, 24), key=mx.random.key(10))
    got = project(linear, x, residual)
    labels = _graph_labels(got, tmp_path)
    assert ("QuantizedMatmul" in labels) is (rows < CPU_DEQUANTIZE_ROWS)
    assert mx.allclose(got, residual + linear(x), atol=1e-4).item()


def test_project_calls_any_other_module() -> None:
    class Doubled(nn.Linear):  # a subclass stands for a sharded layer: its own __call__
        def __call__(self, x: mx.array) -> mx.array:
            return 2 * super().__call__(x)

    layer = Doubled(4, 4)
    x = mx.ones((1, 4))
    assert mx.array_equal(project(layer, x), layer(x)).item()


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_reloaded_weights_are_used_after_decoding(family: str, tmp_path: Path) -> None:
    """A model that already decoded (stacks built) and then gets other weights
    computes what a model opened with those weights does."""
    first, second = tmp_path / "a", tmp_path / "b"
    build_synthetic_install(family, first, vocab_size=128, num_layers=4, seed=1)
    build_synthetic_install(family, second, vocab_size=128, num_layers=4, seed=2)
    prompt = list(range(3, 20))
    reused = Runner.open(first, context_length=64)
    reused.prefill_chunk(prompt, 0)
    reused.produce(5, len(prompt))
    fresh = Runner.open(second, context_length=64)
    reused.model.update(fresh.model.parameters())
    reused.reset()
    fresh.reset()
    got = reused.prefill_chunk(prompt, 0)
    want = fresh.prefill_chunk(prompt, 0)
    assert mx.allclose(got, want, atol=1e-5).item()
    assert mx.allclose(
        reused.produce(5, len(prompt)), fresh.produce(5, len(prompt)), atol=1e-5
    ).item()


@pytest.mark.parametrize("kind", ["plain", "bias", "sharded"])
def test_project_with_a_residual_adds_it(kind: str, tmp_path: Path) -> None:
    """``residual + linear(x)``; a plain layer's add is its GEMM's (one AddMM
    node, no Add), a biased or sharded one's comes after the module's output."""

    class Doubled(nn.Linear):  # a sharded layer's own __call__
        def __call__(self, x: mx.array) -> mx.array:
            return 2 * super().__call__(x)

    layer = Doubled(24, 8) if kind == "sharded" else nn.Linear(24, 8, bias=kind == "bias")
    x = mx.random.normal((2, 3, 24), key=mx.random.key(2))
    residual = mx.random.normal((2, 3, 8), key=mx.random.key(3))
    mx.eval(x, residual, layer.parameters())
    got = project(layer, x, residual)
    if kind == "plain":  # (the graph, before it is evaluated)
        labels = _graph_labels(got, tmp_path)
        assert "AddMM" in labels and "Add" not in labels
    assert mx.allclose(got, residual + layer(x), atol=1e-6).item()


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("lead", [(6,), (1, 1), (1, 5), (16, 1), (3, 7)])
@pytest.mark.parametrize("addend", ["residual", "bias"])
def test_gemm_add_is_the_sum_in_every_form(
    lead: tuple[int, ...], addend: str, gpu: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every form is the sum: one ``AddMM`` node and no ``Add``, batched rows
    folded into its rows on the CPU (MLX's CPU ``addmm`` over a batched C is
    slow); a GPU's one-row product a matmul and an add (no cuBLASLt call)."""
    monkeypatch.setattr(fused, "BUILD_FOR_GPU", gpu)
    x = mx.random.normal((*lead, 24), key=mx.random.key(4))
    shape = (*lead, 8) if addend == "residual" else (8,)
    c = mx.random.normal(shape, key=mx.random.key(5))
    weight_t = mx.random.normal((8, 24), key=mx.random.key(6)).T
    mx.eval(x, c, weight_t)
    got = gemm_add(c, x, weight_t)
    labels = _graph_labels(got, tmp_path)
    if gpu and x.size == 24:
        assert "AddMM" not in labels and "Matmul" in labels and "Add" in labels
    else:
        assert "AddMM" in labels and "Add" not in labels
    assert got.shape == (*lead, 8)
    assert mx.allclose(got, c + x @ weight_t, atol=1e-5).item()


@pytest.mark.parametrize("pieces", [1, 6])
@pytest.mark.parametrize("packing", [(4, 32, "affine"), (8, 64, "affine"), (4, 32, "mxfp4")])
@pytest.mark.parametrize("lead", [(1, 1), (1, 7), (1, 8), (16, 1), (2, 40)])
def test_many_packed_rows_on_the_cpu_are_a_float_matmul(
    lead: tuple[int, ...],
    packing: tuple[int, int, str],
    pieces: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At ``CPU_DEQUANTIZE_ROWS`` rows or more the packed product is a
    ``Matmul`` of the dequantized weight (MLX's CPU quantized product walks
    the weight once a row), its rows in pieces where the weight in float
    would pass ``CPU_DEQUANTIZE_PIECE_BYTES`` (here 48 rows in pieces of 9,
    the last of 3), below it ``QuantizedMatmul``; either equals MLX's
    quantized product up to float32 rounding, in the activations' dtype."""
    if pieces > 1:
        monkeypatch.setattr(stacked_mod, "CPU_DEQUANTIZE_PIECE_BYTES", 9 * 64 * 4 + 7)
    bits, group_size, mode = packing
    weight = mx.random.normal((48, 64), key=mx.random.key(7))
    x = mx.random.normal((*lead, 64), key=mx.random.key(8))
    w, scales, *biases = mx.quantize(weight, group_size=group_size, bits=bits, mode=mode)
    packed = Packed(w, scales, biases[0] if biases else None, group_size, bits, mode)
    got = matmul_t(x, packed)
    labels = _graph_labels(got, tmp_path)
    many = x.size // 64 >= CPU_DEQUANTIZE_ROWS
    assert ("QuantizedMatmul" in labels) is not many
    assert labels.count("Matmul") == (pieces if many else 0)
    want = mx.quantized_matmul(x, *packed[:3], transpose=True, group_size=group_size, bits=bits, mode=mode)  # fmt: skip
    assert got.shape == (*lead, 48) and got.dtype == x.dtype
    assert mx.allclose(got, want, atol=1e-4).item()


class QuantizedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, rows in zip(NAMES, (32, 16, 8), strict=True):
            setattr(self, name, nn.QuantizedLinear(64, rows, group_size=32, bits=4))


@pytest.mark.parametrize("part", ["scales", "biases"])
def test_a_replaced_scale_or_bias_rebuilds_a_quantized_stack(part: str) -> None:
    """The packed weight unchanged, its scales (or biases) replaced: the stack
    and the packed triple a step reads follow, as for a replaced weight."""
    block = QuantizedBlock()
    x = mx.random.normal((1, 1, 64), key=mx.random.key(2))
    first, packed = stacked(block, NAMES), transposed(block.v_proj)
    assert first is not None
    for name in ("k_proj", "v_proj"):
        block[name][part] = block[name][part] * 1.5 + 0.25
    second = stacked(block, NAMES)
    assert second is not None and second is not first
    for got, name in zip(second(x), NAMES, strict=True):
        assert mx.allclose(got, block[name](x), atol=1e-5).item()
    assert transposed(block.v_proj) is not packed
    assert mx.allclose(matmul_t(x, transposed(block.v_proj)), block.v_proj(x), atol=1e-5).item()


@pytest.mark.parametrize("bias", [False, True])
def test_projections_of_different_packings_stack_as_parts(bias: bool) -> None:
    """q at 4 bits, k at 6, v in floating point (a mixed-precision checkpoint):
    one product per module, concatenated, each module's arrays its own; a
    replaced weight rebuilds it. With biases they are left to the modules."""
    block = nn.Module()
    block.q_proj = nn.QuantizedLinear(64, 32, bias=bias, group_size=32, bits=4)
    block.k_proj = nn.QuantizedLinear(64, 16, bias=bias, group_size=32, bits=6)
    block.v_proj = nn.Linear(64, 8, bias=bias)
    stack = stacked(block, NAMES)
    if bias:
        assert stack is None
        return
    assert stack is not None and isinstance(stack.weight_t, PerModule)
    assert stack.weight_t.columns == 56
    x = mx.random.normal((2, 3, 64), key=mx.random.key(3))
    for got, name in zip(stack(x), NAMES, strict=True):
        assert mx.allclose(got, block[name](x), atol=1e-5).item()
    assert mx.allclose(gemm_add(mx.ones(56), x, stack.weight_t), 1 + mx.concatenate(stack(x), -1)).item()  # fmt: skip
    block.k_proj.scales = block.k_proj.scales * 2
    again = stacked(block, NAMES)
    assert again is not None and again is not stack
    assert mx.allclose(again(x)[1], block.k_proj(x), atol=1e-5).item()


def test_a_replaced_bias_rebuilds_the_stack() -> None:
    block = Block(bias=True)
    first = stacked(block, NAMES)
    block.k_proj.bias = block.k_proj.bias + 1
    second = stacked(block, NAMES)
    assert second is not None and second is not first
    x = mx.ones((1, 1, 24))
    assert mx.allclose(second(x)[1], block.k_proj(x)).item()


def _replaced(model: nn.Module, part: str) -> None:
    """Every layer's quantized projections' *part* (``scales`` or
    ``biases``), or its norms' weights (``norm``), replaced by new values
    (the packed weights left as they are)."""
    for path, module in model.named_modules():
        if ".layers." not in f".{path}":
            continue
        quantized = isinstance(module, nn.QuantizedLinear)
        if part == "norm" and not quantized and module.get("weight") is not None:
            if module["weight"].ndim == 1:
                module.update({"weight": module["weight"] * 1.25 + 0.1})
        elif part != "norm" and quantized:
            module.update({part: module[part] * 1.25 + 0.01})
    mx.eval(model.parameters())


@pytest.mark.parametrize("kernels", [False, True], ids=["modules", "kernels"])
@pytest.mark.parametrize("part", ["scales", "biases", "norm"])
@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_replaced_quantized_parts_are_used_after_decoding(
    family: str, part: str, kernels: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quantized model that already decoded (stacks, packed triples and the
    one-trace steps' weights kept) and then gets other scales, biases or norm
    weights under the same packed weights takes its next decode step as a
    model built with them does: the same quantized values dequantized into
    float layers, so none of its kept weights was ever derived from the old
    ones, from the same session state."""
    build_synthetic_install(family, tmp_path, vocab_size=128, num_layers=4, seed=1)
    prompt = list(range(3, 20))
    with ExitStack() as stack:
        if kernels:
            taken = _kernels(stack, monkeypatch)
        reused = _quantized(_open(tmp_path), 4)
        reused.prefill_chunk(prompt, 0)
        reused.produce(5, len(prompt))
        held = reused.snapshot()
        _replaced(reused.model, part)
        after = reused.produce(6, len(prompt) + 1)
        fresh = _quantized(_open(tmp_path), 4)
        _replaced(fresh.model, part)
        dequantize_model(fresh.model)
        fresh.restore(held)
        _close(after, fresh.produce(6, len(prompt) + 1), "the next decode step")
        unchanged = _quantized(_open(tmp_path), 4)
        unchanged.restore(held)
        assert not mx.allclose(after, unchanged.produce(6, len(prompt) + 1), atol=1e-3).item()
        if kernels:
            assert taken["attention"] > 0
            assert taken["gated_delta"] > 0 or family == "gemma4"
