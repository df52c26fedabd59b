"""Our gemma4 hooks against mlx-lm's ``gemma4_text`` on the same install directory.

Every position of a prompt longer than the sliding window, fed token by token
and in uneven chunks, and a few decode steps after it, must give mlx-lm's
logits (float32, CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load_model

from turbospark.sdk import (
    build_synthetic_install,
    family_hooks,
    load_weights,
    peek_manifest_arch,
    read_manifest,
)

PROMPT_LEN = 30
WINDOW = 8
CHUNKS = [5, 1, 9, 3, 12]  # uneven, crossing the window boundary mid-chunk
DECODE = [17, 3, 99, 42]
ATOL = 1e-4

CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {"num_layers": 2, "hidden_size_per_layer_input": 0},
    "moe": {"num_layers": 2, "num_experts": 16, "top_k_experts": 4},
    "kv_shared_ple": {"num_layers": 6},
    "moe_k_eq_v_shared": {
        "num_layers": 4,
        "num_experts": 8,
        "top_k_experts": 2,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "hidden_size_per_layer_input": 0,
    },
}


def _hook() -> Any:
    return family_hooks("gemma4")


def _ours(path: Path) -> tuple[Any, nn.Module]:
    hook = _hook()
    arch = peek_manifest_arch(path)
    model = hook.turbospark_load_model(
        arch=arch, weights=load_weights(path, read_manifest(path)), dtype=mx.float32, experts=None
    )
    return arch, model


def _reference(path: Path, prompt: list[int]) -> np.ndarray:
    """mlx-lm's logits at every prompt position, then after each decode token."""
    model, _ = load_model(path)
    cache = model.make_cache()
    rows = [model(mx.array(prompt)[None], cache=cache)[0]]
    for token in DECODE:
        rows.append(model(mx.array([[token]]), cache=cache)[0])
    return np.array(mx.concatenate(rows).astype(mx.float32))


@pytest.fixture(scope="module", params=list(CONFIGS))
def install(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, np.ndarray, list[int]]:
    path = tmp_path_factory.mktemp(request.param)
    build_synthetic_install(
        "gemma4",
        path,
        vocab_size=128,
        sliding_window=WINDOW,
        model_id="tiny",
        seed=7,
        **CONFIGS[request.param],
    )
    prompt = np.random.default_rng(1).integers(0, 128, PROMPT_LEN).tolist()
    return path, _reference(path, prompt), prompt


def test_sequential_matches_mlx_lm(install: tuple[Path, np.ndarray, list[int]]) -> None:
    path, expected, prompt = install
    arch, model = _ours(path)
    hook = _hook()
    state = hook.turbospark_new_state(arch=arch, model=model, context_length=256)
    got = []
    for position, token in enumerate(prompt + DECODE):
        out = hook.turbospark_forward(
            model=model,
            tokens=mx.array([token]),
            start=position,
            state=state,
            vision=None,
            steer=None,
            logits="last",
        )
        assert out.shape == (arch.vocab_size,) and out.dtype == mx.float32
        got.append(np.array(out))
        assert all(c.position == position + 1 for c in state.values())
    np.testing.assert_allclose(np.stack(got), expected, atol=ATOL)


def test_chunked_matches_mlx_lm(install: tuple[Path, np.ndarray, list[int]]) -> None:
    path, expected, prompt = install
    arch, model = _ours(path)
    hook = _hook()
    state = hook.turbospark_new_state(arch=arch, model=model, context_length=256)
    got, start = [], 0
    assert sum(CHUNKS) == PROMPT_LEN
    for size in CHUNKS:
        out = hook.turbospark_forward(
            model=model,
            tokens=mx.array(prompt[start : start + size]),
            start=start,
            state=state,
            vision=None,
            steer=None,
            logits="all",
        )
        assert out.shape == (size, arch.vocab_size)
        got.append(np.array(out))
        start += size
    # A prefill that skips the head, then decode from it.
    for token in DECODE:
        out = hook.turbospark_forward(
            model=model,
            tokens=mx.array([token]),
            start=start,
            state=state,
            vision=None,
            steer=None,
            logits="last",
        )
        got.append(np.array(out)[None])
        start += 1
    np.testing.assert_allclose(np.concatenate(got), expected, atol=ATOL)


def test_headless_prefill_then_decode(install: tuple[Path, np.ndarray, list[int]]) -> None:
    """``logits="none"`` advances the state exactly like a prefill that reads them."""
    path, expected, prompt = install
    arch, model = _ours(path)
    hook = _hook()
    state = hook.turbospark_new_state(arch=arch, model=model, context_length=256)
    skipped = hook.turbospark_forward(
        model=model,
        tokens=mx.array(prompt),
        start=0,
        state=state,
        vision=None,
        logits="none",
        steer=None,
    )
    assert skipped is None
    out = hook.turbospark_forward(
        model=model,
        tokens=mx.array(DECODE[:1]),
        start=PROMPT_LEN,
        state=state,
        vision=None,
        steer=None,
        logits="last",
    )
    np.testing.assert_allclose(np.array(out), expected[PROMPT_LEN], atol=ATOL)


def test_chunks_read_for_their_last_logits_match_mlx_lm(
    install: tuple[Path, np.ndarray, list[int]],
) -> None:
    """``logits="last"`` runs the KV-shared tail for the last row only: the
    logits after every uneven chunk must still be mlx-lm's at that position."""
    path, expected, prompt = install
    arch, model = _ours(path)
    hook = _hook()
    state = hook.turbospark_new_state(arch=arch, model=model, context_length=256)
    start = 0
    for size in CHUNKS:
        out = hook.turbospark_forward(
            model=model,
            tokens=mx.array(prompt[start : start + size]),
            start=start,
            state=state,
            vision=None,
            steer=None,
            logits="last",
        )
        start += size
        np.testing.assert_allclose(np.array(out), expected[start - 1], atol=ATOL)
