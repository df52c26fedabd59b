"""Quantized checkpoints through every dense path, against mlx-lm on the same checkpoint.

A checkpoint written by ``mlx_lm.convert -q`` (affine, 4 and 8 bits, groups of
32 so the tiny widths divide; the microscaling modes mxfp4, nvfp4 and mxfp8,
which MLX's CPU backend runs too, in the slow set) is imported and opened as any install. Its
logits must be mlx-lm's on the same converted directory (float32, CPU) on
every path a decode takes: token by token (the compiled one-trace steps),
uneven prefill chunks, the CUDA kernels' path (their specifications in ops,
as the kernel-path tests run them), batched rows against each row alone,
drafted greedy against plain. And the fast paths must be taken, not fallen
back from: each layer's end reads its MLP packed (:class:`Packed`), the
attention and gated-DeltaNet one-trace steps run.

The third-party example family is held to mlx-lm the same way. qwen4_exp
(which mlx-lm has no model for) and qwen_gdn's MTP head (which
mlx-lm's convert drops) are quantized by ``nn.quantize`` on the loaded model,
and held to the same model with every quantized layer dequantized to float
(``mlx_lm.utils.dequantize_model``): the packed matmuls against float
matmuls over the same values. Steering is held to that float reference too.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.convert import convert
from mlx_lm.utils import dequantize_model, load_model
from test_steering import random_directions

from helpers import batched_greedy, chunks_and_steps, greedy_both_paths
from turbospark import build_synthetic_install
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.layers.cuda import attention as attention_cuda
from turbospark.layers.cuda import gdn as gdn_cuda
from turbospark.layers.cuda import norm as norm_cuda
from turbospark.layers.cuda import qmv as qmv_cuda
from turbospark.layers.gated_delta import step as gdn_step
from turbospark.layers.layer_end import LayerEnd
from turbospark.layers.stacked import Packed
from turbospark.loading.importer import import_checkpoint
from turbospark.loading.plugins import FamilyRegistry
from turbospark.loading.quantization import quantization_of
from turbospark.policies import DraftPolicies
from turbospark.policies.steering import SteeringPolicy
from turbospark.text import load_text

GROUP = 32
PROMPT = [3 + (7 * i) % 90 for i in range(30)]
# chunks_and_steps' three decode tokens: mlx-lm's reference decodes them too.
DECODE = [5, 6, 7]
# Where chunks_and_steps reads logits: each chunk's last row, then each step.
READ = [12, 25, len(PROMPT) - 1, *range(len(PROMPT), len(PROMPT) + len(DECODE))]
ATOL = 1e-4
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    # Per-layer inputs (a quantized PLE table), two KV-shared layers, a tied head.
    "gemma4": ("gemma4", {"num_layers": 4, "sliding_window": 8, "hidden_size": 128}),
    # Gated-DeltaNet and gated-attention layers, an untied head.
    "qwen_gdn": ("qwen_gdn", {"num_layers": 4}),
}


# (bits, mode, group size, slow): affine in the fast loop, the microscaling modes slow.
SETTINGS = [
    (4, "affine", GROUP, False),
    (8, "affine", GROUP, False),
    (4, "mxfp4", 32, True),
    (4, "nvfp4", 16, True),
    (8, "mxfp8", 32, True),
]


# A microscaling-mode embedding has no floating scales to take a dtype from:
# MLX dequantizes its rows to bfloat16, mlx-lm's and ours alike, and where a
# family feeds them on as they are (gemma4) the activations are bfloat16 on
# both sides, so the two agree to bfloat16's precision only.
BFLOAT16_ATOL = 5e-2


class Converted(NamedTuple):
    install: Path  # the converted checkpoint, imported
    expected: np.ndarray  # mlx-lm's logits at every prompt position, then each decode token
    atol: float  # ATOL, or BFLOAT16_ATOL where mlx-lm's own activations are bfloat16


def _reference(path: Path) -> tuple[np.ndarray, float]:
    model, _ = load_model(path)
    cache = model.make_cache()
    rows = [model(mx.array(PROMPT)[None], cache=cache)[0]]
    rows += [model(mx.array([[token]]), cache=cache)[0] for token in DECODE]
    embeddings = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedEmbedding)]
    bfloat16 = any(m(mx.array([0])).dtype == mx.bfloat16 for m in embeddings)
    atol = BFLOAT16_ATOL if bfloat16 else ATOL
    return np.array(mx.concatenate(rows).astype(mx.float32)), atol


def _params() -> list[Any]:
    return [
        pytest.param(
            (kind, bits, mode, group),
            marks=[pytest.mark.slow] if slow else [],
            id=f"{kind}-{mode}{bits}",
        )
        for kind in KINDS
        for bits, mode, group, slow in SETTINGS
    ]


@pytest.fixture(scope="module", params=_params())
def converted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Converted:
    """A synthetic install, quantized by ``mlx_lm.convert``, imported as an install."""
    kind, bits, mode, group = request.param
    family, dims = KINDS[kind]
    root = tmp_path_factory.mktemp(f"{kind}-{mode}{bits}")
    build_synthetic_install(family, root / "src", vocab_size=128, model_id=kind, **dims)
    convert(
        str(root / "src"), str(root / "mlx"), quantize=True, q_bits=bits, q_group_size=group,
        q_mode=mode,
    )  # fmt: skip
    import_checkpoint(root / "mlx", root / "install", progress=False)
    return Converted(root / "install", *_reference(root / "mlx"))


def _open(path: Path, **kwargs: Any) -> Runner:
    return Runner.open(path, context_length=256, dtype="float32", **kwargs)


def _close(got: Any, want: Any, what: str, atol: float = ATOL) -> None:
    np.testing.assert_allclose(np.array(got), np.array(want), atol=atol, rtol=atol, err_msg=what)


def _ends_read_packed(model: nn.Module) -> int:
    """How many layers' ends read their MLP packed (:meth:`LayerEnd.weights`),
    after asserting every layer with an end does."""
    ends = [(m, m.end) for _, m in model.named_modules() if isinstance(getattr(m, "end", None), LayerEnd)]  # fmt: skip
    for layer, end in ends:
        weights = end.weights(layer)
        assert (
            weights is not None
            and isinstance(weights[2], Packed)
            and isinstance(weights[3], Packed)
        )
    return len(ends)


def _kernels(stack: ExitStack, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every CUDA kernel's path in its ops (the kernel-path tests' forms);
    counts of the one-trace steps taken."""
    taken = {"attention": 0, "gated_delta": 0, "qmv": 0}

    class Rows(attention_cuda.Rows):
        def __init__(self, start: int, stop: int, left: mx.array | None = None):
            taken["attention"] += 1
            super().__init__(start, stop, left)

    trace = gdn_step.step_trace

    def gdn_trace(*args: Any) -> Any:
        taken["gated_delta"] += 1
        return trace(*args)

    def qmv(*args: Any) -> mx.array:
        taken["qmv"] += 1
        return qmv_cuda.qmv_ops(*args)

    for module, name, value in [
        (attention_cuda, "available", lambda: True),
        (attention_cuda, "Rows", Rows),
        (attention_cuda, "decode", attention_cuda.decode_ops),
        (attention_cuda, "decode_step", mx.compile(attention_cuda.decode_ops)),
        (norm_cuda, "available", lambda: True),
        (norm_cuda, "join_norm", norm_cuda.join_norm_ops),
        (gdn_cuda, "available", lambda: True),
        (gdn_cuda, "gated_delta", gdn_cuda.gated_delta_ops),
        (gdn_cuda, "decode_mixer", gdn_cuda.decode_mixer_ops),
        (gdn_step, "step_trace", gdn_trace),
        (qmv_cuda, "available", lambda: True),
        (qmv_cuda, "qmv", qmv),
        (qmv_cuda, "prebuild", lambda model: 0),  # the kernel is its contract: nothing compiles
    ]:
        monkeypatch.setattr(module, name, value)
    stack.callback(monkeypatch.undo)
    return taken


def test_the_converted_checkpoint_loads_quantized(converted: Converted) -> None:
    runner = _open(converted.install)
    specs = quantization_of(runner.model)
    assert len({(s.bits, s.mode, s.group_size) for s in specs.values()}) == 1
    assert _ends_read_packed(runner.model) == runner.arch.num_hidden_layers


def test_steps_and_chunks_match_mlx_lm(converted: Converted) -> None:
    """Token by token (every forward a compiled decode step), then uneven
    chunks and steps: mlx-lm's logits at every position read."""
    runner = _open(converted.install)
    for position, token in enumerate([*PROMPT, *DECODE]):
        got = runner.produce(token, position)
        _close(got, converted.expected[position], f"token {position}", converted.atol)
    logits, _ = chunks_and_steps(_open(converted.install), PROMPT)
    for got, row in zip(logits, READ, strict=True):
        _close(got, converted.expected[row], f"position {row}", converted.atol)


def test_compiled_steps_equal_the_uncompiled_path(converted: Converted) -> None:
    runs = []
    for compiled in (True, False):
        (mx.enable_compile if compiled else mx.disable_compile)()
        try:
            runs.append(chunks_and_steps(_open(converted.install), PROMPT)[0])
        finally:
            mx.enable_compile()
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        _close(a, b, f"forward {i}")


def test_the_kernels_path_matches_mlx_lm(
    converted: Converted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the CUDA kernels' forms, the one-trace attention and gated-DeltaNet
    steps take the packed weights (each step counted), their affine products
    the qmv kernel's path, and still give mlx-lm's logits."""
    with ExitStack() as stack:
        taken = _kernels(stack, monkeypatch)
        logits, _ = chunks_and_steps(_open(converted.install), PROMPT)
    for got, row in zip(logits, READ, strict=True):
        _close(got, converted.expected[row], f"position {row}", converted.atol)
    assert taken["attention"] > 0
    assert taken["gated_delta"] > 0 or "gemma4" in converted.install.parent.name
    assert taken["qmv"] > 0 or "affine" not in converted.install.parent.name


def test_batched_rows_equal_each_row_alone(converted: Converted) -> None:
    prompts = [PROMPT[:9], PROMPT[:20], PROMPT]
    together = batched_greedy(_open(converted.install, session_slots=3), prompts, 4)
    for row, prompt in enumerate(prompts):
        alone = batched_greedy(_open(converted.install), [prompt], 4)
        for step, (a, b) in enumerate(zip(together, alone, strict=True)):
            _close(a[row], b[0], f"row {row}, step {step}")


def greedy_three_ways(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[int], list[int], list[int]]:
    """:func:`greedy_both_paths` over :data:`PROMPT`, the kernels' path stood
    in by :func:`_kernels`: plain, kernels' and drafted greedy tokens."""
    stack = ExitStack()

    def take(kernel: bool) -> None:
        stack.close()
        if kernel:
            _kernels(stack, monkeypatch)

    with stack:
        return greedy_both_paths(install, take, _open, PROMPT)


def test_drafted_greedy_equals_plain(converted: Converted, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy on the plain path, on the kernels' path, and drafted there
    (rejected drafts rewind): the same tokens."""
    plain, kernels, drafted = greedy_three_ways(converted.install, monkeypatch)
    assert plain == kernels == drafted


# -- quantized by nn.quantize on the loaded model: held to its dequantized twin --


def _quantized(runner: Runner, bits: int) -> Runner:
    """*runner*'s model with every linear layer and embedding whose inputs
    divide into groups quantized (as mlx-lm's convert chooses them)."""
    nn.quantize(
        runner.model,
        group_size=GROUP,
        bits=bits,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % GROUP == 0,
    )
    mx.eval(runner.model.parameters())
    assert quantization_of(runner.model)
    return runner


def _twins(path: Path, bits: int, **kwargs: Any) -> tuple[Runner, Runner]:
    """The install quantized, and the same quantized values dequantized to float layers."""
    quantized = _quantized(_open(path, **kwargs), bits)
    reference = _quantized(_open(path, **kwargs), bits)
    dequantize_model(reference.model)
    assert not quantization_of(reference.model)
    return quantized, reference


def _each_close(got: list[mx.array], want: list[mx.array]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        _close(a, b, f"forward {i}")


@pytest.mark.parametrize("bits", [4, 8])
def test_qwen4_exp_quantized_equals_its_float_twin(
    qwen4_exp_install: Path, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain and kernels' paths alike."""
    quantized, reference = _twins(qwen4_exp_install, bits)
    assert any(".layers." in path for path in quantization_of(quantized.model))
    _each_close(chunks_and_steps(quantized, PROMPT)[0], chunks_and_steps(reference, PROMPT)[0])
    with ExitStack() as stack:
        _kernels(stack, monkeypatch)
        quantized, reference = _twins(qwen4_exp_install, bits)
        _each_close(chunks_and_steps(quantized, PROMPT)[0], chunks_and_steps(reference, PROMPT)[0])


def _steered(runner: Runner) -> Runner:
    width = runner.arch.hidden_size
    runner.use_steering(SteeringPolicy.from_directions(random_directions([1], 3, width), 4.0))
    return runner


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])
def test_steering_a_quantized_model_equals_its_float_twin(
    family: str, request: pytest.FixtureRequest
) -> None:
    """The steering folded into the compiled layer ends reads the packed
    weights as the float twin's reads the dequantized ones; it steers."""
    path = request.getfixturevalue(f"{family}_install")
    quantized, reference = (_steered(r) for r in _twins(path, 4))
    steered = chunks_and_steps(quantized, PROMPT)[0]
    _each_close(steered, chunks_and_steps(reference, PROMPT)[0])
    plain = chunks_and_steps(_quantized(_open(path), 4), PROMPT)[0]
    assert not np.allclose(np.array(steered[-1]), np.array(plain[-1]), atol=1e-2)


def test_the_mtp_head_drafts_quantized(mtp_install: Path) -> None:
    """qwen_gdn's MTP head quantized with the rest (mlx-lm's convert drops
    ``mtp.*``, so only our own quantization keeps it): drafted greedy gives
    the plain greedy tokens, and drafts as the float twin's head does."""
    config = GenerationConfig(max_tokens=16, stop_token_ids=[])
    codec = load_text(mtp_install)
    quantized, reference = _twins(mtp_install, 4, draft=DraftPolicies.mtp(2))
    assert any(path.startswith("mtp.") for path in quantization_of(quantized.model))
    drafted = generate(quantized, codec, PROMPT, config)
    twin = generate(reference, codec, PROMPT, config)
    plain = generate(_quantized(_open(mtp_install), 4), codec, PROMPT, config)
    assert drafted.tokens == plain.tokens == twin.tokens
    assert drafted.stats.draft_proposed > 0
    ours, theirs = drafted.stats, twin.stats
    assert (ours.draft_proposed, ours.draft_accepted) == (
        theirs.draft_proposed,
        theirs.draft_accepted,
    )


def test_the_example_family_matches_mlx_lm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The third-party example (it calls its modules, its MLP and layer end
    are core's; a tied head) on a checkpoint mlx-lm quantized: mlx-lm's
    logits token by token and for a chunk."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples" / "third_party_family"))
    from turbospark_tinyllama import plugin

    registry = FamilyRegistry()
    registry.register(plugin, name="tinyllama")
    build_synthetic_install(
        "tinyllama", tmp_path / "src", registry=registry, vocab_size=96, num_layers=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    convert(
        str(tmp_path / "src"), str(tmp_path / "mlx"), quantize=True, q_bits=4, q_group_size=GROUP
    )
    import_checkpoint(tmp_path / "mlx", tmp_path / "install", registry=registry, progress=False)
    runner = _open(tmp_path / "install", registry=registry)
    assert "model.embed_tokens" in quantization_of(runner.model)
    model, _ = load_model(tmp_path / "mlx")
    prompt = PROMPT[:12]
    expected = model(mx.array(prompt)[None])[0]
    for position, token in enumerate(prompt):
        _close(runner.produce(token, position), expected[position], f"token {position}")
    chunked = _open(tmp_path / "install", registry=registry).prefill_chunk(prompt, 0)
    _close(chunked, expected[-1], "the chunk's last row")
