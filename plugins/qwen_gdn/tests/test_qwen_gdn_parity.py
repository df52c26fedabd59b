"""Our qwen_gdn hooks against mlx-lm's ``qwen3_5`` on the same install directory.

A 70-token prompt (longer than one GDN chunk) fed token by token and in
chunks of 32, then decode steps, must give mlx-lm's logits (float32, CPU).
mlx-lm runs the gated delta rule token by token on the CPU, so the chunked
path is checked against the plain recurrence here, through the whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from turbospark.sdk import (
    build_synthetic_install,
    family_hooks,
    load_weights,
    peek_manifest_arch,
    read_manifest,
)

PROMPT_LEN = 70
CHUNKS = [32, 32, 6]
DECODE = [17, 3, 99, 42]
ATOL = 5e-5

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    # Two full layers, tied head, 4 value heads sharing one key head, a 3-tap conv.
    "tied_grouped": {
        "num_layers": 8,
        "tie_word_embeddings": True,
        "linear_num_key_heads": 1,
        "linear_conv_kernel_dim": 3,
        "num_key_value_heads": 1,
    },
}


def _hook() -> Any:
    return family_hooks("qwen_gdn")


def _ours(path: Path, weights: dict[str, mx.array] | None = None) -> tuple[Any, nn.Module]:
    arch = peek_manifest_arch(path)
    weights = load_weights(path, read_manifest(path)) if weights is None else weights
    return arch, _hook().turbospark_load_model(
        arch=arch, weights=weights, dtype=mx.float32, experts=None
    )


def _feed(
    path: Path, sizes: list[int], tokens: list[int], model: nn.Module | None = None
) -> np.ndarray:
    """Our logits at every position, feeding ``tokens`` in pieces of ``sizes``."""
    arch, ours = _ours(path)
    model = ours if model is None else model
    hook = _hook()
    state = hook.turbospark_new_state(arch=arch, model=model, context_length=256)
    rows, start = [], 0
    for size in sizes:
        out = hook.turbospark_forward(
            model=model,
            tokens=mx.array(tokens[start : start + size]),
            start=start,
            state=state,
            vision=None,
            logits="all",
            steer=None,
        )
        assert out.shape == (size, arch.vocab_size) and out.dtype == mx.float32
        start += size
        assert {c.position for c in state.values()} == {start}
        rows.append(np.array(out))
    return np.concatenate(rows)


@pytest.fixture(scope="module", params=list(CONFIGS))
def install(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, np.ndarray, list[int]]:
    path = tmp_path_factory.mktemp(request.param)
    build_synthetic_install(
        "qwen_gdn", path, vocab_size=128, model_id="tiny", seed=3, **CONFIGS[request.param]
    )
    prompt = np.random.default_rng(1).integers(0, 128, PROMPT_LEN).tolist()
    model, _ = load_model(path)
    cache = model.make_cache()
    rows = [model(mx.array(prompt)[None], cache=cache)[0]]
    for token in DECODE:
        rows.append(model(mx.array([[token]]), cache=cache)[0])
    return path, np.array(mx.concatenate(rows)), prompt


def test_sequential_matches_mlx_lm(install: tuple[Path, np.ndarray, list[int]]) -> None:
    path, expected, prompt = install
    tokens = prompt + DECODE
    np.testing.assert_allclose(_feed(path, [1] * len(tokens), tokens), expected, atol=ATOL)


def test_chunked_matches_mlx_lm(install: tuple[Path, np.ndarray, list[int]]) -> None:
    path, expected, prompt = install
    assert sum(CHUNKS) == PROMPT_LEN
    got = _feed(path, CHUNKS + [1] * len(DECODE), prompt + DECODE)
    np.testing.assert_allclose(got, expected, atol=ATOL)


def test_last_and_none_modes(install: tuple[Path, np.ndarray, list[int]]) -> None:
    path, expected, prompt = install
    arch, model = _ours(path)
    hook = _hook()
    state = hook.turbospark_new_state(arch=arch, model=model, context_length=256)
    args = {"model": model, "state": state, "vision": None, "steer": None}
    assert (
        hook.turbospark_forward(tokens=mx.array(prompt[:40]), start=0, logits="none", **args)
        is None
    )
    assert {c.position for c in state.values()} == {40}
    last = hook.turbospark_forward(tokens=mx.array(prompt[40:]), start=40, logits="last", **args)
    assert last.shape == (arch.vocab_size,) and last.dtype == mx.float32
    np.testing.assert_allclose(np.array(last), expected[PROMPT_LEN - 1], atol=ATOL)


def test_mlx_converted_checkpoint_loads_unchanged(
    install: tuple[Path, np.ndarray, list[int]],
) -> None:
    """mlx-lm's own (already sanitized) weights: conv already (C, K, 1), norms
    already shifted, names ``language_model.*``; sanitize must leave them be."""
    path, expected, prompt = install
    reference, _ = load_model(path)
    converted = dict(tree_flatten(reference.parameters()))
    assert any(k.startswith("language_model.model.layers.") for k in converted)
    _, model = _ours(path, weights=converted)
    got = _feed(path, [PROMPT_LEN], prompt, model=model)
    np.testing.assert_allclose(got, expected[:PROMPT_LEN], atol=ATOL)
