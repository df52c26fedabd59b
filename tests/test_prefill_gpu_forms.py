"""Prefill in its GPU forms equals the CPU's.

On CUDA, several queries a row take :func:`turbospark.layers.attention.matmul_attention`
(not the op, whose cuDNN kernel builds a graph per shape), and a gated-DeltaNet
chunk's inverse is built by doubling. ``fused.BUILD_FOR_GPU
= True`` makes the CPU build that form, so each test runs the same prefill both
ways: one row's chunks (``"causal"``, then a mask over held keys; gemma4's
sliding window too) and a batched prefill group over rows holding different
lengths (the padding mask). Float32 on CPU.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import assert_states_close, group_forward, state_arrays
from turbospark import build_synthetic_install
from turbospark.generation.runner import Runner
from turbospark.layers import fused

FAMILIES = ["gemma4", "qwen_gdn", "qwen4_exp"]
# The GPU forms invert a chunk's unit-lower matrix by doubling where the CPU's
# call LAPACK (gated_delta._unit_lower_inverse): the two agree to ~2e-5 (their
# own test), which eight layers carry to ~6e-5; a wrong form is off by far more.
ATOL = 2e-4


@pytest.fixture(scope="module")
def qwen_gdn_deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two full-attention layers (every fourth), so the first one's queries
    before the last reach the logits through the layers after it (the
    session fixture's single attention layer is the last, where only the last
    query's output is read)."""
    path = tmp_path_factory.mktemp("qwen_gdn_deep")
    build_synthetic_install("qwen_gdn", path, vocab_size=128, num_layers=8, model_id="deep")
    return path


def _close(a: mx.array, b: mx.array, what: str) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL, rtol=ATOL, err_msg=what)


@pytest.mark.parametrize("family", [*FAMILIES, "qwen_gdn_deep"])
def test_chunked_prefill_in_gpu_forms_equals_the_cpu_forms(
    family: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 13 tokens, then 21 (past gemma4's synthetic window): every
    chunk's logits (the first is ``"causal"`` where no window cuts it) and
    every state array."""
    install: Path = request.getfixturevalue(
        family if family.endswith("deep") else f"{family}_install"
    )
    prompt = [3 + (7 * i) % 90 for i in range(73)]
    runs = []
    for gpu in (False, True):
        monkeypatch.setattr(fused, "BUILD_FOR_GPU", gpu)
        runner = Runner.open(install, context_length=256, dtype="float32")
        logits = [runner.prefill_chunk(prompt[s : s + 13], s) for s in range(0, 43, 13)]
        logits.append(runner.prefill_chunk(prompt[52:], 52))
        state = runner.sessions()[0].state
        runs.append((logits, state_arrays(state)))
    (cpu_logits, cpu_state), (gpu_logits, gpu_state) = runs
    for i, (a, b) in enumerate(zip(gpu_logits, cpu_logits, strict=True)):
        _close(a, b, f"chunk {i}'s logits")
    assert_states_close(gpu_state, cpu_state, ATOL)


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])  # qwen4_exp: one session slot
def test_batched_prefill_in_gpu_forms_equals_the_cpu_forms(
    family: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rows holding 9, 20 and 31 tokens each take 11 more in one batched
    forward (a prefill group): its logits and every merged state array."""
    install: Path = request.getfixturevalue(f"{family}_install")
    runs = []
    for gpu in (False, True):
        monkeypatch.setattr(fused, "BUILD_FOR_GPU", gpu)
        runner = Runner.open(install, context_length=256, dtype="float32", session_slots=4)
        runs.append(group_forward(runner))
    (cpu_logits, cpu_state), (gpu_logits, gpu_state) = runs
    _close(gpu_logits, cpu_logits, "the group's logits")
    assert_states_close(gpu_state, cpu_state, ATOL)
