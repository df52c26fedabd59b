"""The gated-DeltaNet layers' kernel path equals their reference forms, on the CPU.

On MLX's CUDA backend a gated-DeltaNet layer hands its recurrence, q/k norm
and gates to one kernel (:mod:`turbospark.layers.cuda.gdn`) for prefill
chunks, batched groups and verify passes alike, and a verify pass keeps every
token's state from it; a decode step hands it everything between its two GEMMs
(the bias, the conv and its tail, the gated norm as well). The CUDA source runs
only on a GPU (``tests/test_gdn_cuda.py``); here the kernels are replaced by
their specifications in ops (:func:`~turbospark.layers.cuda.gdn.gated_delta_ops`,
:func:`~turbospark.layers.cuda.gdn.decode_mixer_ops`), so everything
around it (the slices it reads, the conv tail, the traced states a cut keeps,
batching) is checked against the reference forms wherever the suite runs.
Float32 on CPU.
"""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import (
    GDN_DIMS,
    assert_states_close,
    batched_greedy,
    chunks_and_steps,
    gdn_inputs,
    gdn_reference,
    group_forward,
    verify_and_cut,
)
from turbospark.generation.drafters import ReplayDrafter
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.layers.cuda import gdn as gdn_cuda
from turbospark.text import load_text

FAMILIES = ["qwen_gdn", "qwen4_exp"]
PROMPT = [3 + (7 * i) % 90 for i in range(47)]
# The reference prefill is the chunked WY form (LAPACK's inverse); the kernel
# steps token by token: float32 apart by ~1e-5, which the layers carry to a few 1e-5.
ATOL = 1e-4


@pytest.fixture(params=FAMILIES)
def install(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_install")


def _forms(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> None:
    monkeypatch.setattr(gdn_cuda, "available", lambda: kernel)
    monkeypatch.setattr(gdn_cuda, "gated_delta", gdn_cuda.gated_delta_ops)
    monkeypatch.setattr(gdn_cuda, "decode_mixer", gdn_cuda.decode_mixer_ops)


def _open(path: Path, slots: int = 1) -> Runner:
    return Runner.open(path, context_length=256, dtype="float32", session_slots=slots)


def _close(a: mx.array, b: mx.array, what: str) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL, rtol=ATOL, err_msg=what)


def test_chunks_and_steps_equal_the_reference_forms(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uneven chunks (13 tokens, then the rest), then three decode steps: every
    chunk's logits, every step's, and every state array at the end."""
    runs = []
    for kernel in (False, True):
        _forms(monkeypatch, kernel)
        runs.append(chunks_and_steps(_open(install), PROMPT))
    (ref_logits, ref_state), (got_logits, got_state) = runs
    for i, (a, b) in enumerate(zip(got_logits, ref_logits, strict=True)):
        _close(a, b, f"forward {i}'s logits")
    assert_states_close(got_state, ref_state, ATOL)


@pytest.mark.parametrize("keep", [0, 1, 3, 5])
def test_a_verify_pass_and_its_cut_equal_the_reference_forms(
    install: Path, keep: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 5-token verify pass (the kernel keeps every token's state): its logits,
    the state a cut to *keep* tokens leaves, and the step after it."""
    runs = []
    for kernel in (False, True):
        _forms(monkeypatch, kernel)
        runs.append(verify_and_cut(_open(install), PROMPT, [7, 5, 9, 17, 33], keep))
    (ref_logits, ref_after, ref_state), (got_logits, got_after, got_state) = runs
    _close(got_logits, ref_logits, "verify logits")
    _close(got_after, ref_after, "the step after the cut")
    assert_states_close(got_state, ref_state, ATOL)


@pytest.mark.parametrize("accuracy", [1.0, 0.5, 0.0])
def test_greedy_drafting_on_the_kernel_path_equals_off(
    install: Path, accuracy: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temperature-0 output with any drafter is ``off``'s token for token, and
    the session holds no rejected token."""
    _forms(monkeypatch, True)
    config = GenerationConfig(max_tokens=20, stop_token_ids=[])
    off = generate(_open(install), load_text(install), PROMPT, config)
    runner = _open(install)
    drafter = ReplayDrafter([*PROMPT, *off.tokens], runner.vocab_size, 4, accuracy, seed=3)
    drafted = generate(runner, load_text(install), PROMPT, config, drafter=drafter)
    assert drafted.tokens == off.tokens
    assert runner.sessions()[0].record.tokens == [*PROMPT, *off.tokens[:-1]]


def test_a_batched_group_and_batched_decode_equal_the_reference_forms(
    qwen_gdn_install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows holding 9, 20 and 31 tokens take 11 more in one batched forward (a
    prefill group), then rows at different positions decode together."""
    prompts = [list(range(3 + r, 20 + 3 * r)) for r in range(3)]
    runs = []
    for kernel in (False, True):
        _forms(monkeypatch, kernel)
        group, state = group_forward(_open(qwen_gdn_install, slots=4))
        steps = batched_greedy(_open(qwen_gdn_install, slots=4), prompts, 4)
        runs.append((group, state, steps))
    (ref_group, ref_state, ref_steps), (got_group, got_state, got_steps) = runs
    _close(got_group, ref_group, "the group's logits")
    assert_states_close(got_state, ref_state, ATOL)
    for step, (a, b) in enumerate(zip(got_steps, ref_steps, strict=True)):
        _close(a, b, f"batched step {step}")


def test_the_ops_form_equals_the_reference_recurrence() -> None:
    """The specification itself against the layer's reference pieces (the same
    comparison ``tests/test_gdn_cuda.py`` makes for the kernel on a GPU)."""
    for dims in GDN_DIMS[:2]:
        mixed, proj, rate, state, a_offset = gdn_inputs(2, 6, dims, mx.float32, seed=1)
        want_y, want_states = gdn_reference(mixed, proj, rate, state, dims, a_offset)
        y, last, kept = gdn_cuda.gated_delta_ops(
            mixed, proj, rate, state, *dims, a_offset, keep=True
        )
        _close(y, want_y, "outputs")
        _close(kept, want_states, "every token's state")
        assert mx.array_equal(last, kept[:, -1])


def test_the_decode_mixers_ops_equal_the_reference_layer() -> None:
    """:func:`~turbospark.layers.cuda.gdn.decode_mixer_ops` (what the decode
    kernel is checked against on a GPU) against the layer's reference
    :func:`~turbospark.layers.gated_delta.mix` for one token, rows batched."""
    from turbospark.layers.gated_delta.gates import input_bias
    from turbospark.layers.gated_delta.layer import mix

    rng = np.random.default_rng(4)
    for hk, hv, dk, dv in GDN_DIMS[:2]:
        conv, value_dim, hidden = 2 * hk * dk + hv * dv, hv * dv, 12
        x = mx.array(rng.standard_normal((3, 1, hidden)), mx.float32)
        in_proj_t = mx.array(rng.standard_normal((hidden, conv + value_dim + 2 * hv)) * 0.3)
        tail = mx.array(rng.standard_normal((3, 3, conv)), mx.float32)
        state = mx.array(rng.standard_normal((3, hv, dv, dk)) * 0.3, mx.float32)
        weights = (
            mx.array(rng.standard_normal((conv, 4, 1)) * 0.5, mx.float32),
            mx.array(-np.exp(rng.standard_normal(hv) * 0.5), mx.float32),
            input_bias(mx.array(rng.standard_normal(hv), mx.float32), in_proj_t.shape[1]),
            mx.array(1 + 0.1 * rng.standard_normal(dv), mx.float32),
        )
        conv_w, rate, bias, norm_w = weights
        dims = (hk, hv, dk, dv, 1e-6)
        want = mix(x, in_proj_t, tail, state, conv_w, rate, bias, norm_w, *dims)
        out, new_state, new_tail = gdn_cuda.decode_mixer_ops(
            x @ in_proj_t, tail, conv_w, bias, rate, state, norm_w, *dims
        )
        for got, ref, what in zip(
            (out, new_tail, new_state), want, ("output", "tail", "state"), strict=True
        ):
            _close(got, ref, what)


@pytest.mark.parametrize("keep", [2, 5])
def test_a_cut_keeps_only_its_own_state_alive(
    qwen_gdn_install: Path, keep: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a verify pass is cut (or kept whole), no layer's state is a view
    that keeps the pass's every state alive: the memory the process grew by
    stays within one gated-DeltaNet state of what the session's ``nbytes``
    grew by (the pass leaves a few KB of cached constants; views of its five
    states would keep four states more)."""
    _forms(monkeypatch, True)
    runner = _open(qwen_gdn_install)
    runner.prefill_chunk(PROMPT, 0)
    session = runner.sessions()[0]
    mx.eval([a for c in session.state.values() for a in c.arrays()])
    gc.collect()
    base, held = mx.get_active_memory(), session.nbytes
    logits = runner.verify(None, [7, 5, 9, 17, 33], len(PROMPT))
    runner.accept(None, len(PROMPT), keep)
    mx.eval(logits, [a for c in session.state.values() for a in c.arrays()])
    del logits
    gc.collect()
    assert mx.get_active_memory() - base <= session.nbytes - held + session.state["gdn"].nbytes
