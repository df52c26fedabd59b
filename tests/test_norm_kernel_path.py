"""The families' residual joins made with their norms equal their plain forms, on the CPU.

On MLX's CUDA backend an unsteered dense layer of gemma4 or qwen_gdn makes
each residual join in one kernel with the RMS norms beside it
(:func:`~turbospark.layers.cuda.norm.join_norm`) and hands its last join to
the next layer's input norm (or the final norm) unjoined
(:class:`~turbospark.layers.cuda.norm.Unjoined`). The CUDA source runs only on
a GPU (``tests/test_norm_cuda.py``); here the kernel is replaced by its
specification in ops (:func:`~turbospark.layers.cuda.norm.join_norm_ops`), so
the restructured layers (what each join adds, which norm makes it, the
KV-shared tail's last token, a steered layer between unjoined ones, the MTP
head, batches) are checked against the plain forms wherever the suite runs.
Float32 on CPU.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import (
    assert_states_close,
    batched_greedy,
    chunks_and_steps,
    greedy_both_paths,
    group_forward,
    kind_install,
    mtp_drafts_both_paths,
    verify_and_cut,
)
from turbospark.generation.runner import Runner
from turbospark.layers.cuda import norm as norm_cuda
from turbospark.policies.steering import SteeringPolicy

PROMPT = [3 + (7 * i) % 90 for i in range(37)]
# The plain forms add a projection's residual inside its GEMM (addmm); the joins
# add it after: float32 apart by an ulp or two, which the layers carry to ~1e-5.
ATOL = 2e-5
# Dense gemma4 with per-layer inputs and two KV-shared layers, dense gemma4
# without per-layer inputs, and qwen_gdn (gated DeltaNet and attention layers).
KINDS = {
    "gemma4": ("gemma4", {"num_layers": 4, "sliding_window": 8}),
    "gemma4_no_ple": ("gemma4", {"num_layers": 4, "hidden_size_per_layer_input": 0}),
    "qwen_gdn": ("qwen_gdn", {"num_layers": 4, "mtp": True}),
}


@pytest.fixture(scope="module", params=list(KINDS))
def install(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kind_install(tmp_path_factory.mktemp(f"joins-{request.param}"), *KINDS[request.param])


def _forms(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> None:
    monkeypatch.setattr(norm_cuda, "available", lambda: kernel)
    monkeypatch.setattr(norm_cuda, "join_norm", norm_cuda.join_norm_ops)


def _open(path: Path, slots: int = 1, **kwargs) -> Runner:
    return Runner.open(path, context_length=256, dtype="float32", session_slots=slots, **kwargs)


def _close(a: mx.array, b: mx.array, what: str) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL, rtol=ATOL, err_msg=what)


def test_chunks_and_steps_equal_the_plain_forms(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uneven chunks, then three decode steps: every forward's logits and every
    state array at the end."""
    runs = []
    for kernel in (False, True):
        _forms(monkeypatch, kernel)
        runs.append(chunks_and_steps(_open(install), PROMPT))
    (ref_logits, ref_state), (got_logits, got_state) = runs
    for i, (a, b) in enumerate(zip(got_logits, ref_logits, strict=True)):
        _close(a, b, f"forward {i}'s logits")
    assert_states_close(got_state, ref_state, ATOL)


def test_a_group_and_batched_decode_equal_the_plain_forms(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [list(range(3 + r, 20 + 3 * r)) for r in range(3)]
    runs = []
    for kernel in (False, True):
        _forms(monkeypatch, kernel)
        group, state = group_forward(_open(install, slots=4))
        runs.append((group, state, batched_greedy(_open(install, slots=4), prompts, 4)))
    (ref_group, ref_state, ref_steps), (got_group, got_state, got_steps) = runs
    _close(got_group, ref_group, "the group's logits")
    assert_states_close(got_state, ref_state, ATOL)
    for step, (a, b) in enumerate(zip(got_steps, ref_steps, strict=True)):
        _close(a, b, f"batched step {step}")


@pytest.mark.parametrize("keep", [0, 3])
def test_a_verify_pass_and_its_cut_equal_the_plain_forms(
    install: Path, keep: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = []
    for kernel in (False, True):
        _forms(monkeypatch, kernel)
        runs.append(verify_and_cut(_open(install), PROMPT, [7, 5, 9, 17, 33], keep))
    (ref_logits, ref_after, ref_state), (got_logits, got_after, got_state) = runs
    _close(got_logits, ref_logits, "verify logits")
    _close(got_after, ref_after, "the step after the cut")
    assert_states_close(got_state, ref_state, ATOL)


def test_greedy_output_equals_the_plain_forms(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temperature 0, token for token: plain, joined, and joined with a drafter."""
    plain, joined, drafted = greedy_both_paths(install, partial(_forms, monkeypatch), _open, PROMPT)
    assert joined == plain == drafted


def test_a_steered_layer_between_joined_ones(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steering layer 2 only (llama.cpp's numbering: the second layer's output):
    the layers before and after it hand their joins on, the steered one joins
    its input first and makes its own join as before."""
    runner = _open(install)
    width = runner.arch.hidden_size
    direction = np.random.default_rng(1).normal(0, 4, width).astype(np.float32)
    policy = SteeringPolicy.from_directions({2: direction})
    runs = []
    for kernel in (False, True):
        _forms(monkeypatch, kernel)
        runner = _open(install, steering=policy)
        logits = [runner.prefill_chunk(PROMPT, 0), runner.produce(5, len(PROMPT))]
        runs.append(logits)
    for what, a, b in zip(("prefill", "step"), runs[1], runs[0], strict=True):
        _close(a, b, f"steered {what}")
    _forms(monkeypatch, False)
    unsteered = _open(install).prefill_chunk(PROMPT, 0)
    assert not np.allclose(np.array(unsteered), np.array(runs[0][0]), atol=1e-3)


def test_the_mtp_head_drafts_as_on_the_plain_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen_gdn's MTP head is a decoder layer too: its unjoined output goes through
    the head's norm. The drafted output and the draft statistics match."""
    take = partial(_forms, monkeypatch)
    runs = mtp_drafts_both_paths(tmp_path / "mtp", KINDS["qwen_gdn"][1], take, _open, PROMPT)
    assert runs[0] == runs[1]


def test_the_ops_form_is_its_spelled_out_math() -> None:
    """The specification (the GPU test's reference) against the module
    docstring's three lines in plain ops."""
    keys = mx.random.split(mx.random.key(0), 5)
    h, update = (mx.random.normal((2, 3, 48), key=k) for k in keys[:2])
    uw, w = (1 + 0.1 * mx.random.normal((48,), key=k) for k in keys[2:4])
    scale = mx.array([0.75])

    def rms(x: mx.array, weight: mx.array) -> mx.array:
        return x * mx.rsqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6) * weight

    joined, normed = norm_cuda.join_norm_ops(h, update, w, 1e-6, uw, scale)
    want = (h + rms(update, uw)) * scale
    _close(joined, want, "joined")
    _close(normed, rms(want, w), "normed")
    plain, none = norm_cuda.join_norm_ops(h, update, None, 1e-6)
    assert none is None and mx.array_equal(plain, h + update)
