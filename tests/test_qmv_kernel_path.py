"""Which packed products :func:`~turbospark.layers.stacked.matmul_t` hands the qmv kernel, on the CPU.

On MLX's CUDA backend a product of at most
:data:`~turbospark.layers.cuda.qmv.R_MAX` rows by an affine packing of 4 or 8
bits in groups of 32, 64 or 128 is the kernel
(:func:`~turbospark.layers.cuda.qmv.qmv`); every other product keeps
``mx.quantized_matmul``. The kernel runs only on a GPU
(``tests/test_qmv_cuda.py``); here it is replaced by a recorder over its
contract in ops (:func:`~turbospark.layers.cuda.qmv.qmv_ops`), so the routing
is checked wherever the suite runs: each packing and shape taken or not, the
result the op's either way, the choice made when a compiled function is
traced, the variant each product is launched with (the table, the knob and
its errors), and a quantized model's decode steps (every product of a step
the kernel's; a prefill chunk's none). Float32 on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import dequantize_model

from helpers import batched_greedy, chunks_and_steps
from turbospark.generation.runner import Runner
from turbospark.layers.cuda import kernel as kernel_module
from turbospark.layers.cuda import qmv as qmv_cuda
from turbospark.layers.stacked import Packed, matmul_t

WIDTH = 256


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of x the kernel was handed (its contract computing them),
    with the kernel available as on CUDA."""
    shapes: list[tuple[int, ...]] = []

    def recorder(x: mx.array, *args: object) -> mx.array:
        shapes.append(x.shape)
        return qmv_cuda.qmv_ops(x, *args)

    monkeypatch.setattr(qmv_cuda, "available", lambda: True)
    monkeypatch.setattr(qmv_cuda, "qmv", recorder)
    monkeypatch.setattr(qmv_cuda, "prebuild", lambda model: 0)  # nothing compiles here
    return shapes


def _packed(bits: int, group_size: int, mode: str = "affine", outputs: int = 40) -> Packed:
    weight = mx.random.normal((outputs, WIDTH), key=mx.random.key(bits + group_size))
    w, scales, *biases = mx.quantize(weight, group_size=group_size, bits=bits, mode=mode)
    return Packed(w, scales, biases[0] if biases else None, group_size, bits, mode)


def _x(*lead: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    return mx.random.normal((*lead, WIDTH), key=mx.random.key(len(lead))).astype(dtype)


def _op(x: mx.array, weight_t: Packed) -> mx.array:
    w, scales, biases, group_size, bits, mode = weight_t
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode
    )


@pytest.mark.parametrize("group_size", qmv_cuda.GROUP_SIZES)
@pytest.mark.parametrize("bits", qmv_cuda.BITS)
@pytest.mark.parametrize("lead", [(1, 1), (1,), (qmv_cuda.R_MAX, 1), (1, 3), (2, 2, 2)])
def test_few_rows_of_a_supported_packing_take_the_kernel(
    lead: tuple[int, ...], bits: int, group_size: int, taken: list[tuple[int, ...]]
) -> None:
    weight_t = _packed(bits, group_size)
    x = _x(*lead)
    got = matmul_t(x, weight_t)
    assert taken == [x.shape]
    assert got.shape == (*lead, weight_t.columns)
    assert mx.array_equal(got, _op(x, weight_t)).item()


@pytest.mark.parametrize(
    ("what", "weight_t", "x"),
    [
        ("more rows than R_MAX", _packed(4, 64), _x(qmv_cuda.R_MAX + 1, 1)),
        ("a prefill chunk", _packed(4, 64), _x(1, 13)),
        ("2 bits", _packed(2, 64), _x(1, 1)),
        ("3 bits", _packed(3, 64), _x(1, 1)),
        ("6 bits", _packed(6, 64), _x(1, 1)),
        ("mxfp4 (no biases)", _packed(4, 32, "mxfp4"), _x(1, 1)),
        ("mxfp8 (no biases)", _packed(8, 32, "mxfp8"), _x(1, 1)),
        ("scales of another dtype", _packed(4, 64), _x(1, 1, dtype=mx.bfloat16)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_other_products_keep_mlx_op(
    what: str, weight_t: Packed, x: mx.array, taken: list[tuple[int, ...]]
) -> None:
    got = matmul_t(x, weight_t)
    assert taken == [], what
    assert mx.array_equal(got, _op(x, weight_t)).item()


def test_unavailable_never_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the kernel is not available (no CUDA), and with it
    available but its switch (``TURBOSPARK_QMV_KERNEL=0``) off it is not either."""
    assert not qmv_cuda.available()
    weight_t = _packed(4, 64)
    x = _x(1, 1)
    assert not qmv_cuda.takes(x, *weight_t)
    monkeypatch.setattr(qmv_cuda.fused, "takes_cuda_kernels", lambda enabled: enabled)
    assert qmv_cuda.takes(x, *weight_t)
    monkeypatch.setattr(qmv_cuda, "ENABLED", False)
    assert not qmv_cuda.takes(x, *weight_t)


def test_the_choice_is_made_when_a_compiled_function_traces(
    taken: list[tuple[int, ...]],
) -> None:
    """A compiled step takes the kernel once, when traced, and replays it;
    a new row count traces anew."""
    weight_t = _packed(8, 32)
    step = mx.compile(lambda x, w, s, b: matmul_t(x, Packed(w, s, b, 32, 8, "affine")))
    arrays = weight_t[:3]
    for seed in range(3):
        x = mx.random.normal((1, 1, WIDTH), key=mx.random.key(seed))
        assert mx.array_equal(step(x, *arrays), _op(x, weight_t)).item()
    assert taken == [(1, 1, WIDTH)]
    step(_x(3, 1), *arrays)
    assert taken == [(1, 1, WIDTH), (3, 1, WIDTH)]


def test_the_table_picks_each_products_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """:data:`~turbospark.layers.cuda.qmv.TABLE`'s entry with the fewest rows
    at or above a product's (of its bits) is the variant the kernel is built
    and launched with; none covering it, the default; a forced one (the
    ``TURBOSPARK_QMV_VARIANT`` knob) over all of them."""
    V = qmv_cuda.Variant
    monkeypatch.setattr(qmv_cuda, "FORCED", None)
    monkeypatch.setattr(qmv_cuda, "TABLE", {(4, 1): V(4, 2, True), (4, 8): V(8, 1, False), (8, 2): V(2, 4, True)})  # fmt: skip
    assert qmv_cuda.variant_for(4, 1) == V(4, 2, True)
    assert qmv_cuda.variant_for(4, 2) == qmv_cuda.variant_for(4, 8) == V(8, 1, False)
    assert qmv_cuda.variant_for(8, 1) == V(2, 4, True)
    assert qmv_cuda.variant_for(8, 3) == qmv_cuda.DEFAULT
    launched: list[dict] = []

    def kernel(**call: object) -> list[mx.array]:
        launched.append(call)
        return [mx.zeros(call["output_shapes"][0])]

    monkeypatch.setattr(qmv_cuda, "_kernel", lambda: kernel)
    weight_t = _packed(4, 64, outputs=40)
    for rows, (outs, unroll, shared) in [(1, V(4, 2, True)), (5, V(8, 1, False))]:
        qmv_cuda.qmv(_x(rows, 1), *weight_t[:5])
        template = dict(launched[-1]["template"])
        assert (template["OUTS"], template["UNROLL"], template["SHARED_X"]) == (
            outs,
            unroll,
            shared,
        )
        blocks = -(-40 // (qmv_cuda.WARPS * outs))
        assert launched[-1]["grid"] == (blocks * qmv_cuda.WARPS * 32, 1, 1)
    monkeypatch.setattr(qmv_cuda, "FORCED", V(2, 1, False))
    assert qmv_cuda.variant_for(4, 1) == qmv_cuda.variant_for(8, 3) == V(2, 1, False)


@pytest.mark.parametrize(
    ("text", "problem"),
    [("4,2", "three integers"), ("a,b,c", "three integers"), ("3,2,1", "OUTS must be one of"),
     ("4,3,1", "UNROLL one of"), ("4,2,2", "SHARED_X 0 or 1"), ("", "three integers")],
)  # fmt: skip
def test_a_bad_variant_is_a_one_line_error(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as raised:
        qmv_cuda.parse_variant(text)
    assert "\n" not in str(raised.value)
    assert qmv_cuda.parse_variant(" 8, 1,0") == qmv_cuda.Variant(8, 1, False)


def test_the_variant_knob_is_read_at_import() -> None:
    """``TURBOSPARK_QMV_VARIANT`` forces a variant in a fresh process, and a
    bad one stops the import with the one-line error."""
    code = "from turbospark.layers.cuda import qmv; print(qmv.FORCED)"
    env = {**os.environ, "TURBOSPARK_QMV_VARIANT": "4,2,1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "4,2,1", done.stderr[-2000:]
    env["TURBOSPARK_QMV_VARIANT"] = "5,2,1"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("ValueError: qmv variant '5,2,1'")


def _quantized(path: Path, session_slots: int = 1) -> Runner:
    runner = Runner.open(path, context_length=256, dtype="float32", session_slots=session_slots)
    nn.quantize(
        runner.model, group_size=32, bits=4,
        class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0,
    )  # fmt: skip
    mx.eval(runner.model.parameters())
    return runner


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_a_quantized_models_decode_steps_take_it_and_chunks_do_not(
    family: str, request: pytest.FixtureRequest, taken: list[tuple[int, ...]]
) -> None:
    """Uneven prefill chunks, then decode steps, on a model quantized at 4
    bits: the kernel is handed products of at most R_MAX rows (the steps'
    attention layers, traced per layer, at least), and the logits are the
    same model's with its quantized values dequantized to float layers."""
    path: Path = request.getfixturevalue(f"{family}_install")
    prompt = [3 + (7 * i) % 90 for i in range(30)]
    got = chunks_and_steps(_quantized(path), prompt)[0]
    assert taken
    assert all(np.prod(shape[:-1]) <= qmv_cuda.R_MAX for shape in taken)
    twin = _quantized(path)
    dequantize_model(twin.model)
    want = chunks_and_steps(twin, prompt)[0]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4, err_msg=f"{i}")


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_prebuild_starts_every_kernel_a_quantized_models_steps_compile(
    family: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """:func:`~turbospark.layers.cuda.qmv.prebuild` starts the sources the
    kernel's calls compile: a quantized model's decode steps, a lone row's and
    a batch of three's, through the real wrapping (NVRTC and MLX's launch
    replaced: the launch computes the contract), compile nothing it did not
    start, and it starts each packing's 1 to R_MAX rows."""
    path: Path = request.getfixturevalue(f"{family}_install")
    runner = _quantized(path, session_slots=3)
    started: list[str] = []
    compiled: list[str] = []

    def launch(*, name: str, inputs: list[mx.array], **_: object) -> list[mx.array]:
        x, w, scales, biases = inputs
        bits = w.shape[1] * 32 // x.shape[-1]
        return [qmv_cuda.qmv_ops(x, w, scales, biases, x.shape[-1] // scales.shape[1], bits)]

    def prebuild(sources: Iterable[tuple[str, str]]) -> int:
        started.extend(name for name, _ in sources)
        return len(started)

    monkeypatch.setattr(qmv_cuda, "available", lambda: True)
    monkeypatch.setattr(kernel_module, "prebuild", prebuild)
    monkeypatch.setattr(kernel_module, "cubin", lambda name, source: compiled.append(name) or b"")
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch)
    packings = {
        (m.weight.shape[1], m.group_size, m.bits)
        for _, m in runner.model.named_modules()
        if isinstance(m, nn.QuantizedLinear)
    }
    assert qmv_cuda.prebuild(runner.model) == len(packings) * qmv_cuda.R_MAX == len(set(started))
    prompt = [3 + (7 * i) % 90 for i in range(30)]
    chunks_and_steps(runner, prompt)
    runner.reset()
    batched_greedy(runner, [prompt[:9], prompt[:12], prompt[:20]], steps=2)
    assert compiled and set(compiled) <= set(started)
