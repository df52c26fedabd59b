"""A verify pass in its GPU forms equals the CPU's, and drafting with them equals ``off``.

On a GPU a lone row's short traced pass takes forms with fewer kernels
(:func:`turbospark.layers.gated_delta.mix_unrolled`: the gated-DeltaNet
stepped token by token, every token's state kept; few-query attention by
matmuls with a host-built causal mask). ``fused.BUILD_FOR_GPU = True`` makes
the CPU build them, so each test runs the same pass both ways: the logits, the
state a cut back to every prefix leaves, and the step after it; and a batch's
decode, which must keep its own forms. Float32 on CPU.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import assert_states_close, batched_greedy, verify_and_cut
from turbospark.generation.drafters import ReplayDrafter
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.layers import fused
from turbospark.text import load_text

FAMILIES = ["gemma4", "qwen_gdn", "qwen4_exp"]
PROMPT = [*range(3, 30), *range(3, 15)]
TOKENS = [7, 5, 9, 17, 33]  # a confirmed token and four drafts
# The prompt's prefill inverts its gated-DeltaNet chunks by doubling in the GPU
# forms and by LAPACK in the CPU's: ~2e-5 apart (test_prefill_gpu_forms).
ATOL = 5e-5


@pytest.fixture(params=FAMILIES)
def install(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_install")


def _open(path: Path) -> Runner:
    return Runner.open(path, context_length=256, dtype="float32")


def _close(a: mx.array, b: mx.array, what: str) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL, rtol=ATOL, err_msg=what)


@pytest.mark.parametrize(("length", "keep"), [(5, 0), (5, 1), (5, 3), (5, 5), (2, 1)])
def test_a_verify_pass_in_gpu_forms_equals_the_cpu_forms(
    install: Path, length: int, keep: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logits of a pass of *length* tokens, every component's arrays after the
    cut to *keep* tokens, and the next step's logits."""
    tokens = TOKENS[:length]
    runs = []
    for gpu in (False, True):
        monkeypatch.setattr(fused, "BUILD_FOR_GPU", gpu)
        runs.append(verify_and_cut(_open(install), PROMPT, tokens, keep))
    (cpu_logits, cpu_after, cpu_state), (gpu_logits, gpu_after, gpu_state) = runs
    _close(gpu_logits, cpu_logits, "verify logits")
    _close(gpu_after, cpu_after, "the step after the cut")
    assert_states_close(gpu_state, cpu_state, ATOL)


@pytest.mark.parametrize("accuracy", [1.0, 0.5, 0.0])
def test_greedy_drafting_in_gpu_forms_equals_off(
    install: Path, accuracy: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the GPU forms forced, temperature-0 output with any drafter is
    ``off``'s token for token, and the session holds no rejected token."""
    monkeypatch.setattr(fused, "BUILD_FOR_GPU", True)
    config = GenerationConfig(max_tokens=24, stop_token_ids=[])
    off = generate(_open(install), load_text(install), PROMPT, config)
    runner = _open(install)
    drafter = ReplayDrafter([*PROMPT, *off.tokens], runner.vocab_size, 4, accuracy, seed=3)
    drafted = generate(runner, load_text(install), PROMPT, config, drafter=drafter)
    assert drafted.tokens == off.tokens
    assert drafted.stats.draft_proposed + drafted.stats.draft_probed > 0
    assert runner.sessions()[0].record.tokens == [*PROMPT, *off.tokens[:-1]]


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn"])  # qwen4_exp: one session slot
def test_batched_decode_in_gpu_forms_equals_the_cpu_forms(
    family: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows at different positions decoding together (one masked query a row)
    keep the batched forms: only a lone row's few queries take the verify
    pass's attention."""
    install = request.getfixturevalue(f"{family}_install")
    prompts = [list(range(3 + r, 20 + 3 * r)) for r in range(3)]
    runs = []
    for gpu in (False, True):
        monkeypatch.setattr(fused, "BUILD_FOR_GPU", gpu)
        runner = Runner.open(install, context_length=256, dtype="float32", session_slots=4)
        runs.append(batched_greedy(runner, prompts, 4))
    for step, (cpu, gpu) in enumerate(zip(*runs, strict=True)):
        _close(gpu, cpu, f"batched step {step}")
