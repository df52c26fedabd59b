"""Compiled decode equals uncompiled decode, token for token and logit for logit.

Every ``mx.compile`` in the forward (the fused elementwise chains, the
gated-DeltaNet step, the per-layer feed-forward halves) claims to compute the
uncompiled expression op for op. ``mx.disable_compile()`` runs exactly that
expression, so each test runs the same request both ways: one row through
``stream_generate`` (its pipelined loop), and a batch through the family's
batched forward at several batch sizes (each traced once). A last test checks
that decode steps after the first do not trace again. Float32 on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import pytest

from helpers import batched_greedy
from turbospark import build_synthetic_install
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.layers.fused import STEP_TOKENS
from turbospark.text import load_text

T = TypeVar("T")
CONTEXT = 160
# Gemma 4 with every branch: PLE, MoE beside the dense MLP, KV-shared tail
# layers (4 layers -> 2 shared), a window the decode runs past.
FAMILIES = {
    "gemma4": {"num_layers": 4, "num_experts": 4, "top_k_experts": 2, "sliding_window": 8},
    "qwen_gdn": {"num_layers": 4},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_install(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    family = request.param
    path = tmp_path_factory.mktemp(f"compiled-{family}")
    build_synthetic_install(family, path, vocab_size=128, model_id=f"compiled-{family}", **FAMILIES[family])  # fmt: skip
    return path


@contextmanager
def compile_disabled() -> Iterator[None]:
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()


def both_ways(run: Callable[[], T]) -> tuple[T, T]:
    """*run* compiled, then with compilation off (the plain expressions)."""
    compiled = run()
    with compile_disabled():
        plain = run()
    return compiled, plain


def test_stream_generate_same_tokens_compiled_or_not(family_install: Path) -> None:
    codec = load_text(family_install)
    prompt = list(range(3, 40))
    config = GenerationConfig(max_tokens=40, stop_token_ids=[], chunk_size=16)

    def run() -> list[int]:
        runner = Runner.open(family_install, context_length=CONTEXT)
        return generate(runner, codec, prompt, config).tokens

    compiled, plain = both_ways(run)
    assert len(compiled) == 40
    assert compiled == plain


def test_decode_logits_match_compiled_or_not(family_install: Path) -> None:
    """Teacher-forced decode: each step's logits agree to float32 rounding."""
    prompt, forced = list(range(5, 30)), [7, 99, 3, 64, 12, 5, 88, 41, 2, 17, 70, 9]

    def run() -> list[mx.array]:
        runner = Runner.open(family_install, context_length=CONTEXT)
        out = [runner.prefill_chunk(prompt, 0)]
        for i, token in enumerate(forced):
            out.append(runner.produce(token, len(prompt) + i))
        mx.eval(out)
        return out

    compiled, plain = both_ways(run)
    for step, (a, b) in enumerate(zip(compiled, plain, strict=True)):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item(), f"step {step} differs"


@pytest.mark.parametrize("drafts", [1, 4, STEP_TOKENS - 1, STEP_TOKENS])
def test_verify_logits_and_rollback_match_compiled_or_not(
    family_install: Path, drafts: int
) -> None:
    """A draft's verify pass (a lone row's short forward, compiled up to
    STEP_TOKENS tokens, uncompiled past it), the cut back to an accepted
    prefix, and the step after it."""
    prompt, forced = list(range(5, 30)), [7, 99, 3, 64, 12, 5, 88, 41, 2, 17][: drafts + 1]
    keep = max(1, len(forced) // 2)

    def run() -> list[mx.array]:
        runner = Runner.open(family_install, context_length=CONTEXT)
        runner.prefill_chunk(prompt, 0, logits=False)
        verified = runner.verify(None, forced, len(prompt))
        runner.accept(None, len(prompt), keep)
        after = runner.produce(50, len(prompt) + keep)
        mx.eval(verified, after)
        return [verified, after]

    compiled, plain = both_ways(run)
    for what, a, b in zip(("verify", "after the cut"), compiled, plain, strict=True):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item(), f"{what} differs"


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_batched_decode_same_tokens_compiled_or_not(family_install: Path, rows: int) -> None:
    """The batched step (the engine's) at several batch sizes: greedy ids equal,
    logits to float32 rounding."""
    prompts = [list(range(3 + r, 20 + 3 * r)) for r in range(rows)]

    def run() -> list[mx.array]:
        runner = Runner.open(family_install, context_length=CONTEXT, session_slots=rows + 1)
        return batched_greedy(runner, prompts, 12)

    compiled, plain = both_ways(run)
    for step, (a, b) in enumerate(zip(compiled, plain, strict=True)):
        assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item(), step
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item(), f"step {step} differs"


# A name each compiled decode function looks up only while tracing: counting its
# calls counts the traces (prefill, uncompiled, calls it too, so none runs here).
# The attention inputs (``normed_heads``) trace once too: RoPE reads the step's
# offset as a device array, not as a constant of the trace.
TRACED = {
    "gemma4": [
        ("turbospark.layers.layer_end", "side_parts"),
        ("turbospark_gemma4.model", "normed_heads"),
    ],
    "qwen_gdn": [
        ("turbospark.layers.layer_end", "activation"),
        ("turbospark_qwen_gdn.model", "normed_heads"),
        ("turbospark.layers.gated_delta.layer", "gated_delta"),
    ],
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_steps_do_not_retrace(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After one step at a batch size, later steps (new positions, a KV buffer
    that grows past its block, a window that slides) reuse the trace. Dense
    layers only: Gemma's MoE layers call ``side_parts`` uncompiled
    (:meth:`~turbospark.layers.layer_end.LayerEnd.finish`)."""
    import importlib

    dims = {**FAMILIES[family], "num_experts": 0} if family == "gemma4" else FAMILIES[family]
    build_synthetic_install(family, tmp_path, vocab_size=128, model_id="retrace", **dims)
    runner = Runner.open(tmp_path, context_length=400)
    runner.prefill_chunk([3 + i % 120 for i in range(249)], 0)
    position = 250
    mx.eval(runner.produce(5, position - 1))
    calls = {"n": 0}
    for module_name, name in TRACED[family]:
        module = importlib.import_module(module_name)
        real = getattr(module, name)

        def counted(*args, _real=real, **kwargs):
            calls["n"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    for step in range(12):  # crosses the 256-row KV block boundary
        mx.eval(runner.produce(7 + step, position + step))
    assert calls["n"] == 0
